"""The llama.cpp backend's reusable logits buffers (``RowBuffers``): a buffer is handed out
again only when no tensor, view or array made from it is alive."""

import gc

import torch

from adaspec.backends.llamacpp import RowBuffers


def test_rows_have_the_asked_shape_and_distinct_memory():
    rb = RowBuffers(10, rows=3, count=2)
    a, b = rb.take(2), rb.take(1)
    assert a.shape == (2, 10) and b.shape == (1, 10) and a.dtype == torch.float32
    assert a.data_ptr() != b.data_ptr()
    c = rb.take(1)  # every buffer held: a fresh tensor
    assert c.data_ptr() not in (a.data_ptr(), b.data_ptr())


def test_a_buffer_is_reused_only_when_nothing_views_it():
    rb = RowBuffers(10, rows=3, count=1)
    a = rb.take(2)
    a.fill_(7.0)
    ptr = a.data_ptr()
    view = a[1:]
    del a
    gc.collect()
    b = rb.take(1)  # a torch view keeps the buffer
    assert b.data_ptr() != ptr
    del view, b
    arr = rb.take(3).numpy()  # a numpy array made from the rows keeps it too
    assert arr.ctypes.data == ptr
    c = rb.take(1)
    assert c.data_ptr() != ptr
    del arr, c
    d = rb.take(3)
    assert d.data_ptr() == ptr  # free again: the same memory, no new pages


def test_rows_wider_than_the_buffers_are_fresh_tensors():
    rb = RowBuffers(10, rows=3, count=2)
    big = rb.take(5)
    assert big.shape == (5, 10)
    small = rb.take(1)
    assert small.data_ptr() != big.data_ptr()


def test_held_rows_keep_their_values_across_later_takes():
    rb = RowBuffers(4, rows=2, count=2)
    kept = rb.take(1)
    kept.copy_(torch.arange(4.0).view(1, 4))
    for _ in range(5):  # later forwards write their own buffers, never the held one
        rb.take(2).fill_(-1.0)
    assert torch.equal(kept, torch.arange(4.0).view(1, 4))
