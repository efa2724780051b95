"""Self-distillation data, domain training prompts and domain retrieval datastores.

MetaSD F.1 trains each specialised drafter on the target's own responses to task prompts,
sampled greedily and at a few temperatures. This module

* generates training prompts per domain from our own templates and slot lists (deterministic
  given a seed, disjoint from the benchmark suites in ``adaspec/data/prompts``: held-out
  evaluation depends on it),
* runs the target over a prompt set, batched with left padding, and stores the responses as
  token ids with the target's fingerprint (format ``adaspec.distill/1``, below), resumably,
* builds REST-style suffix datastores (He et al. 2024) from those responses.

Format ``adaspec.distill/1``: a directory with

* ``meta.json``: ``{"format": "adaspec.distill/1", "target": target_fingerprint(target),
  "domain": str, "temperatures": [float], "max_new_tokens": int, "created": ISO time,
  "n_samples": int}``
* ``samples.jsonl``: one line per response, ``{"prompt_id": str, "temperature": float,
  "seed": int, "prompt_ids": [int], "output_ids": [int]}``; ``output_ids`` hold no padding
  and end after the first EOS (kept), or at ``max_new_tokens``.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import random
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch
import typer

from .errors import AdaspecError, ConfigError, ModelLoadError, PromptError
from .models import LoadedModel, check_fingerprint, target_fingerprint

log = logging.getLogger(__name__)

DISTILL_FORMAT = "adaspec.distill/1"
DOMAINS: tuple[str, ...] = ("code", "math", "chat", "summarization", "translation")
DEFAULT_TEMPERATURES: tuple[float, ...] = (0.0, 0.7)
#: rows per ``generate`` call. SmolLM2-135M, fp32, 1 thread, busy shared 2-core machine, 64 new
#: tokens: 7.6 / 18.2 / 25.5 / 36.3 tokens/s at batch 1 / 4 / 8 / 16; with 128 tokens 38.6 at 8,
#: 49.7 at 16 and 50.6 at 32 (decoding becomes compute-bound near 16 rows)
DEFAULT_BATCH_SIZE = 16
#: progress(stage, done, total)
Progress = Callable[[str, int, int], None]
#: a prompt: text (the chat template is applied), chat messages, or token ids
PromptInput = str | list[int] | list[dict[str, str]]


# =============================================================================================
# Domain training prompts (templates x slot lists written for adaspec)
# =============================================================================================
_CODE_SUBJECTS: tuple[tuple[str, str, str], ...] = (
    ("count_vowels", "text", "counts the vowels in a string"),
    ("merge_sorted", "a, b", "merges two sorted lists into one sorted list"),
    ("flatten_once", "nested", "flattens a list of lists by one level"),
    ("second_largest", "numbers", "returns the second largest distinct number in a list"),
    ("is_prime", "n", "checks whether an integer is a prime number"),
    ("gcd", "a, b", "computes the greatest common divisor of two integers with Euclid's algorithm"),
    ("rotate_right", "items, k", "rotates a list to the right by k positions"),
    ("unique_in_order", "items", "removes duplicates from a list while keeping the first occurrence of each item"),
    ("run_length_encode", "text", "compresses a string with run-length encoding, so that 'aaab' becomes 'a3b1'"),
    ("transpose", "matrix", "transposes a matrix given as a list of rows"),
    ("longest_word", "sentence", "returns the longest word in a sentence"),
    ("title_case", "sentence", "capitalizes the first letter of every word in a sentence"),
    ("digit_sum", "n", "returns the sum of the digits of a non-negative integer"),
    ("factorial", "n", "computes the factorial of a non-negative integer"),
    ("are_anagrams", "a, b", "checks whether two strings are anagrams of each other, ignoring spaces"),
    ("count_nonempty_lines", "path", "counts the non-empty lines in a text file"),
    ("median", "numbers", "returns the median of a list of numbers"),
    ("max_subarray_sum", "numbers", "returns the largest sum of a contiguous sublist"),
    ("to_snake_case", "name", "converts a camelCase identifier to snake_case"),
    ("looks_like_email", "address", "checks that a string has the basic shape of an email address"),
    ("matmul", "a, b", "multiplies two matrices given as lists of lists"),
    ("find_missing", "numbers", "finds the one missing number in a list that should hold every integer from 1 to n"),
    ("clamp", "x, low, high", "limits a number to the range from low to high"),
    ("caesar_shift", "text, shift", "encrypts a string with a Caesar cipher that shifts letters by a given amount"),
    ("running_mean", "numbers", "returns the running average after each element of a list"),
    ("brackets_balanced", "text", "checks whether the round, square and curly brackets in a string are balanced"),
    ("roman_to_int", "numeral", "converts a Roman numeral to an integer"),
    ("to_binary", "n", "converts a non-negative integer to a binary string without using bin()"),
    ("interleave", "a, b", "interleaves two lists and appends the rest of the longer one"),
    ("invert_dict", "mapping", "swaps the keys and values of a dictionary"),
    ("pairs_with_sum", "numbers, target", "finds all pairs of numbers in a list that add up to a target"),
    ("count_long_words", "text, n", "counts the words in a text that have more than n letters"),
    ("hamming_distance", "a, b", "counts the positions at which two strings of equal length differ"),
    ("power_set", "items", "returns all subsets of a list"),
    ("triangular", "n", "returns the n-th triangular number"),
    ("most_common", "numbers", "returns the most frequent value in a list"),
    ("pascal_row", "n", "returns the n-th row of Pascal's triangle"),
    ("squeeze_spaces", "text", "replaces every run of spaces in a string with a single space"),
    ("reverse_digits", "n", "reverses the digits of an integer and keeps its sign"),
    ("safe_divide", "a, b", "divides two numbers and returns None instead of failing on division by zero"),
)
_CODE_TEMPLATES: tuple[str, ...] = (
    "Write a Python function `{name}({args})` that {desc}. Include a docstring.",
    "Implement `{name}({args})` in Python: it {desc}. Add type hints and handle edge cases.",
    "Write a Python function that {desc}, and show two example calls with the expected output.",
    "Explain how you would write a function that {desc}, then give the Python code.",
    "Write pytest unit tests for a function `{name}({args})` that {desc}.",
    "Write a JavaScript function `{js}({args})` that {desc}.",
    "Write a Python function `{name}({args})` that {desc}, without importing any module.",
    "What is the time complexity of a simple Python function that {desc}? Write it and explain.",
    "Write a Go function that {desc}.",
    "I need a helper that {desc}. Write it in Python and comment each step.",
)

_POEM_TOPICS = ("the first snow of winter", "an old bicycle", "a quiet library", "morning coffee",
                "a city at night", "the sea after a storm", "a lost glove", "autumn leaves",
                "a train station", "a grandmother's kitchen", "the moon over a lake", "a busy market",
                "a sleeping dog", "a garden in spring", "the last day of school", "a mountain path")
_CHAT_SLOTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Write a short poem about {x}.", _POEM_TOPICS),
    ("Write three haiku about {x}.", _POEM_TOPICS),
    ("Explain {x} to a ten-year-old.", (
        "how rainbows form", "why the moon has phases", "what electricity is", "how airplanes stay in the air",
        "what a computer program is", "why we need sleep", "how plants drink water", "what gravity does",
        "how money works", "why ice floats", "what DNA is", "how a compass works", "why volcanoes erupt",
        "how the internet sends messages", "what an echo is", "why leaves change colour")),
    ("Give me five practical tips for {x}.", (
        "learning to cook on a budget", "keeping a houseplant alive", "studying for an exam",
        "running a first 5 km race", "sleeping better", "saving money on groceries", "learning a new language",
        "keeping a tidy desk", "preparing for a job interview", "taking better photos with a phone",
        "starting a vegetable garden", "reading more books", "speaking in public", "staying focused at work",
        "travelling with a small suitcase", "organising a birthday party")),
    ("Write a friendly email to a colleague asking them to {x}.", (
        "review my slides before Friday", "swap shifts with me next Tuesday", "share the notes from yesterday's call",
        "join a planning call on Thursday", "help test a new feature", "send the updated budget figures",
        "give feedback on a draft report", "cover a customer call while I am away",
        "book a room for the workshop", "suggest a date for the team lunch",
        "check the translation of a brochure", "mentor a new intern for a week")),
    ("What are the advantages and disadvantages of {x}?", (
        "buying a used car", "living in a big city", "learning the piano as an adult", "reading on an e-reader",
        "owning a dog", "taking a gap year", "cycling to work", "renting instead of buying a home",
        "studying abroad", "using a paper planner", "cooking meals in advance for the week", "shopping online")),
    ("Write the opening paragraph of a story about {x}.", (
        "a baker who can hear thoughts", "a robot that wants to become a gardener",
        "two friends lost in a snowstorm", "a detective who is afraid of the dark",
        "a child who finds a map in the attic", "a musician on her last concert tour",
        "a village where it never stops raining", "a cat that runs a bookshop",
        "an astronaut coming home after ten years", "a clockmaker who can stop time",
        "a ferry captain on a foggy night", "a girl who collects forgotten words")),
    ("How does {x} work? Keep the answer short.", (
        "a bicycle gear system", "a microwave oven", "a solar panel", "a thermostat", "a touch screen",
        "a hot air balloon", "a zipper", "a card payment in a shop", "a dishwasher", "an electric kettle",
        "a barcode scanner", "a lock and key")),
    ("Write a short product description for {x}.", (
        "a foldable wooden desk", "a quiet mechanical keyboard", "a solar-powered garden lamp",
        "a set of ceramic coffee mugs", "a waterproof hiking backpack", "a plant pot that reminds you to water it",
        "a handmade leather notebook", "a portable espresso maker", "a children's bicycle helmet with lights",
        "a wool blanket", "a reusable lunch box", "a desk lamp with adjustable colour")),
    ("Write a thank-you note to {x}.", (
        "a neighbour who watered my plants", "a teacher at the end of the school year",
        "a friend who lent me a tent", "a nurse who cared for my father", "a host family after a summer stay",
        "a coach after a great season", "a colleague who trained me", "a stranger who returned my wallet",
        "a librarian who found a rare book for me", "my grandparents for a birthday present")),
    ("Describe {x} in a few vivid sentences.", (
        "a harbour at sunrise", "a crowded train at rush hour", "a forest after rain",
        "a small café on a winter evening", "a football stadium before kick-off", "a desert at noon",
        "a night market", "an empty beach in October", "a school playground at break time",
        "a mountain hut during a storm")),
    ("Suggest a plan for {x}.", (
        "a relaxing Sunday at home", "a first week of learning to run", "a museum visit with young children",
        "clearing out a cluttered garage", "a birthday dinner for six friends", "a week of healthy breakfasts",
        "a weekend hiking trip for beginners", "a study group that meets twice a week")),
    ("Explain the difference between {x}.", (
        "a lake and a pond", "a simile and a metaphor", "an alligator and a crocodile", "a stock and a bond",
        "baking soda and baking powder", "a meteor and a comet", "speed and velocity",
        "a hurricane and a tornado", "empathy and sympathy", "a frog and a toad",
        "a debit card and a credit card", "a museum and a gallery")),
)

_SENTENCES: tuple[str, ...] = (
    "My brother is learning to play the guitar.", "The bakery on the corner sells fresh bread every morning.",
    "Could you tell me where the nearest pharmacy is?", "We are going to visit our grandparents next weekend.",
    "The meeting has been moved to three o'clock.", "I forgot my umbrella at the restaurant.",
    "The children built a sandcastle on the beach.", "This soup needs a little more salt.",
    "She reads the newspaper while she drinks her coffee.", "The last bus leaves at eleven at night.",
    "Our neighbours have a very friendly cat.", "I would like to book a table for two people.",
    "The museum is closed on Mondays.", "He runs five kilometres every Saturday morning.",
    "The price of apples has gone up this year.", "Please send me the documents by email.",
    "It started snowing just after we arrived.", "The library has a new section for teenagers.",
    "We planted tomatoes and beans in the garden.", "My phone battery is almost empty.",
    "The concert was wonderful, but the hall was too warm.", "Turn left after the bridge and you will see the station.",
    "I have been learning to swim since January.", "The doctor told me to drink more water.",
    "Can I pay by card, or only in cash?", "The film starts in twenty minutes.",
    "They painted the kitchen a bright yellow.", "Our flight was delayed because of fog.",
    "I need a new pair of shoes for the wedding.", "The teacher explained the exercise twice.",
    "We watched the sunset from the top of the hill.", "My sister works as a nurse in a large hospital.",
    "The shop opens at nine and closes at seven.", "I am allergic to peanuts.",
    "He fixed the broken chair with some glue.", "The river flooded the fields after the storm.",
    "Do you know a good place to eat near here?", "The hotel room had a view of the mountains.",
    "She won first prize in the photography competition.", "I lost my keys somewhere in the park.",
    "The new bridge will open next spring.", "We usually have dinner at half past seven.",
    "The dog barks whenever the postman comes.", "I prefer tea without sugar.",
    "The students are preparing a play for the end of the year.", "It is too noisy to work in this café.",
    "My grandfather grew up on a farm by the sea.", "The parcel should arrive on Thursday.",
)
_LANGUAGES = ("French", "Spanish", "German")
_TRANSLATION_TEMPLATES: tuple[str, ...] = (
    "Translate into {lang}: '{s}'",
    "How would you say this in {lang}? \"{s}\"",
    "Translate the following sentence into {lang} and keep the tone natural:\n\n{s}",
    "Give the {lang} translation of this sentence: {s}",
)


def _math_problem(rng: random.Random) -> str:
    """One arithmetic word problem with seeded random numbers (18 kinds) and an answer style."""
    r = rng.randint
    kind = rng.randrange(18)
    if kind == 0:
        q = (f"A bakery sells {r(20, 90)} loaves of bread each morning and {r(10, 60)} in the afternoon. "
             f"How many loaves does it sell in {r(3, 14)} days?")
    elif kind == 1:
        q = (f"Lena has {r(30, 120)} stickers. She gives {r(5, 25)} to her cousin and then buys "
             f"{r(5, 40)} more. How many stickers does she have now?")
    elif kind == 2:
        q = (f"A rectangular table top measures {r(60, 200)} cm by {r(40, 120)} cm. What are its area "
             "and its perimeter?")
    elif kind == 3:
        q = (f"A lamp costs {r(20, 150)} dollars and is on sale for {rng.choice([10, 15, 20, 30, 40])}% off. "
             "What is the sale price?")
    elif kind == 4:
        a, b = r(2, 8), r(3, 12)
        q = (f"If {a} painters can paint a fence in {b} hours, how long would {a + r(1, 6)} painters take, "
             "working at the same rate?")
    elif kind == 5:
        a, x, b = r(2, 12), r(-9, 15), r(-30, 30)
        q = f"Solve for x: {a}x {'+' if b >= 0 else '-'} {abs(b)} = {a * x + b}."
    elif kind == 6:
        q = f"What is {rng.choice([5, 12, 15, 25, 35, 40, 60, 75])}% of {r(40, 900)}?"
    elif kind == 7:
        q = (f"A pump moves {r(15, 80)} litres of water per minute. How long does it take to fill a pond "
             f"that holds {r(2, 30) * 100} litres?")
    elif kind == 8:
        a, b = sorted((r(1, 60), r(61, 400)))
        q = f"Compute the sum of all integers from {a} to {b}."
    elif kind == 9:
        q = (f"A savings account pays {rng.choice([2, 3, 4, 5, 6])}% simple interest per year. How much "
             f"interest do {r(5, 80) * 100} dollars earn in {r(2, 9)} years?")
    elif kind == 10:
        a, b = r(2, 9) * 50, r(2, 6) * 6
        q = (f"A recipe needs {a} grams of flour for {b} muffins. How much flour is needed for "
             f"{b * r(2, 5) + rng.choice([0, b // 2])} muffins?")
    elif kind == 11:
        q = (f"A hiker walks at {r(3, 6)} km/h for {rng.choice([40, 45, 50, 75, 90, 100])} minutes. "
             "How far does she walk?")
    elif kind == 12:
        a, b = r(6, 60) * r(1, 4), r(6, 60) * r(1, 4)
        q = f"Find the greatest common divisor and the least common multiple of {a} and {b}."
    elif kind == 13:
        q = (f"A club has {r(20, 90)} members, and {rng.choice([20, 25, 40, 50, 60, 75])}% of them came to the "
             "last meeting. How many members did not come?")
    elif kind == 14:
        a, b = r(20, 90), r(20, 80)
        q = f"Two angles of a triangle are {a} degrees and {b} degrees. What is the third angle?"
    elif kind == 15:
        q = (f"A jar holds {r(2, 12)} yellow, {r(2, 12)} white and {r(2, 12)} black beads. If one bead is "
             "picked at random, what is the probability that it is not white?")
    elif kind == 16:
        q = (f"A car uses {rng.choice([4.5, 5, 5.5, 6, 6.5, 7, 8])} litres of fuel per 100 km. How much fuel "
             f"does it need for a trip of {r(3, 90) * 10} km?")
    else:
        nums = [r(1, 99) for _ in range(r(5, 8))]
        q = f"What are the mean and the range of the numbers {', '.join(map(str, nums))}?"
    style = rng.choice(("", " Show your reasoning step by step.", " Explain each step.",
                        " Give the final answer on its own line."))
    return q + style


_TOWNS = ("Brackwater", "Hollin Cross", "Wendmoor", "Sallowby", "Fernhallow", "Kestrel Bay", "Ormsfield",
          "Dunmere", "Calloway", "Thistlecombe", "Ravensholt", "Pellbridge")
_RIVERS = ("Ashe", "Tarrow", "Lune", "Corrin", "Wyle", "Brent")
_COMPANIES = ("Norland Foods", "Quillmark", "Bluefen Systems", "Harrowgate Textiles", "Lumen & Reed",
              "Copperleaf Games", "Westerly Bikes", "Tidewell Energy")
_PRODUCTS = ("frozen pizzas", "fountain pens", "home routers", "wool jumpers", "desk lamps", "board games",
             "folding bikes", "solar batteries")
_ANIMALS = ("hedgehogs", "river otters", "barn owls", "honeybees", "red squirrels", "sea turtles", "bats")
_PEOPLE = ("Ada Morrell", "Tomas Lindqvist", "Greta Oyelaran", "Hugo Marchetti", "Nadia Farrokh",
           "Piotr Zielinski", "Ines Carvalho", "Walter Abbot")
_JOBS = ("engineer", "architect", "botanist", "journalist", "cartographer", "pharmacist", "ship's cook")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
           "October", "November", "December")


def _passage(rng: random.Random) -> tuple[str, list[str]]:
    """A short synthetic passage (an opening sentence and 3-5 of the kind's other sentences, in
    order) from sentence templates, and questions it answers."""
    r = rng.randint
    kind = rng.randrange(7)
    if kind == 0:
        town, river, year = rng.choice(_TOWNS), rng.choice(_RIVERS), r(1150, 1890)
        first = f"{town} is a small town on the river {river}, founded in {year}."
        rest = [f"It grew around a wool market that was held every {rng.choice(_MONTHS)}.",
                f"A stone bridge was built in {year + r(40, 200)} and still carries traffic today.",
                f"The railway reached {town} in {r(1850, 1910)}, and the population doubled within thirty years.",
                f"A fire in {r(1700, 1950)} destroyed most of the old wooden houses near the church.",
                f"Today about {r(2, 40) * 1000:,} people live there, and tourism is the largest employer.",
                f"The town museum keeps a collection of {r(100, 900)} old maps of the valley."]
        qs = [f"When was {town} founded?", f"Which river is {town} on?", f"What is {town} known for?"]
    elif kind == 1:
        co, prod, pct = rng.choice(_COMPANIES), rng.choice(_PRODUCTS), r(3, 35)
        quarter = rng.choice(("first", "second", "third", "fourth"))
        first = f"{co} sold {r(5, 90) * 1000:,} {prod} in the {quarter} quarter, {pct}% more than a year earlier."
        rest = [f"Most of the growth came from online orders, which now make up {r(20, 70)}% of sales.",
                f"The company opened a new warehouse near {rng.choice(_TOWNS)} and hired {r(12, 150)} people.",
                f"Costs rose because of higher shipping prices, so profit grew by only {r(1, pct)}%.",
                f"A recall of {r(200, 3000)} faulty units cost the company about {r(1, 9) * 100},000 euros.",
                f"The chief executive, {rng.choice(_PEOPLE)}, said demand was strongest in {rng.choice(_TOWNS)}.",
                "The board expects sales to stay strong until the end of the year."]
        qs = [f"How many {prod} did {co} sell in the {quarter} quarter?", f"How did {co}'s sales change?",
              "What does the board expect?"]
    elif kind == 2:
        animal, years, n = rng.choice(_ANIMALS), r(2, 12), r(40, 900)
        first = f"Researchers from the University of {rng.choice(_TOWNS)} followed {n} {animal} for {years} years."
        rest = [f"They found that the animals travelled {r(2, 9)} times farther in dry years than in wet ones.",
                f"Young {animal} were more likely to survive when they lived near old hedges or woodland.",
                f"The team used small tags that recorded position every {r(5, 60)} minutes.",
                f"About {r(5, 40)}% of the tagged animals were never found again.",
                f"The study was paid for by a grant of {r(50, 900)},000 euros.",
                "They recommend protecting corridors of vegetation between farms."]
        qs = [f"How many {animal} did the researchers follow, and for how long?",
              f"What did the researchers find about {animal}?", "How did the team collect its data?"]
    elif kind == 3:
        town, visitors = rng.choice(_TOWNS), r(3, 60) * 500
        event = rng.choice(("kite festival", "cheese fair", "street music day", "boat race", "book market"))
        first = (f"The {town} {event} took place on {r(1, 28)} {rng.choice(_MONTHS)} and attracted about "
                 f"{visitors:,} visitors.")
        rest = [f"It was organised by volunteers for the {r(2, 40)}th time.",
                f"Entry was free, but parking cost {r(2, 9)} euros for the day.",
                "Heavy rain in the afternoon forced the organisers to move the main stage into the school hall.",
                f"Local shops reported their busiest day since {r(2005, 2022)}.",
                f"A prize of {r(1, 20) * 50} euros went to {rng.choice(_PEOPLE)}.",
                "Next year the event will last two days instead of one."]
        qs = [f"How many people visited the {event}?", f"Who organised the {event}?",
              f"When did the {event} take place?"]
    elif kind == 4:
        person, born, job = rng.choice(_PEOPLE), r(1880, 1975), rng.choice(_JOBS)
        name = person.split()[0]
        first = f"{person} was born in {born} in {rng.choice(_TOWNS)} and trained as a {job}."
        rest = [f"After {r(4, 20)} years of work abroad, {name} returned home and started a small school.",
                f"The school taught evening classes to about {r(20, 300)} adults a year.",
                f"{name} also wrote {r(2, 12)} books about the history of the region.",
                f"In {born + r(35, 60)} {name} received a regional prize for education.",
                f"{name} died in {born + r(61, 95)}, and the school is now run by a foundation.",
                "Many former students later said the classes had changed their lives."]
        qs = [f"What did {person} train as?", f"When was {person} born?", f"What did {name} start?"]
    elif kind == 5:
        town, pool = rng.choice(_TOWNS), rng.choice(("swimming pool", "sports hall", "public library",
                                                      "bus station", "community garden"))
        first = (f"The council of {town} has approved a plan to renovate the {pool} at a cost of {r(2, 40)} "
                 "million euros.")
        rest = [f"Work will start in {rng.choice(_MONTHS)} and should take about {r(6, 30)} months.",
                f"During the works, residents can use a temporary site {r(1, 9)} km away.",
                f"The new building will use {r(20, 60)}% less energy thanks to solar panels and better insulation.",
                f"{r(30, 400)} residents signed a petition asking for longer opening hours.",
                f"Part of the money comes from a national fund for {rng.choice(('sport', 'culture', 'transport'))}.",
                "Some councillors voted against the plan because of rising building costs."]
        qs = [f"How much will the renovation of the {pool} cost?", "How long will the works take?",
              "Why did some councillors vote against the plan?"]
    else:
        prod, co = rng.choice(_PRODUCTS), rng.choice(_COMPANIES)
        first = f"To return one of the {prod} bought from {co}, customers have {r(14, 60)} days from delivery."
        rest = ["Items must be unused and in their original packaging, and the receipt is required.",
                f"Refunds are paid to the original payment card within {r(3, 14)} working days.",
                f"Return shipping is free for orders over {r(3, 12) * 10} euros; otherwise it costs {r(3, 9)} euros.",
                "Damaged items should be reported within 48 hours, with a photo of the damage.",
                f"Customers in {rng.choice(_TOWNS)} can also return items at the company's shop.",
                "Gift cards and personalised items cannot be returned."]
        qs = ["How long do customers have to return an item?", "When is return shipping free?",
              "Which items cannot be returned?"]
    keep = sorted(rng.sample(range(len(rest)), r(3, 5)))
    return " ".join([first, *(rest[i] for i in keep)]), qs


def _summarization_prompt(rng: random.Random) -> str:
    text, questions = _passage(rng)
    if rng.random() < 0.5:
        instr = rng.choice(("Summarize this text in two sentences.", "Write a one-sentence summary of the text "
                            "below.", "List the three most important facts from this text as bullet points.",
                            "Give this text a short title and a summary of at most 40 words.",
                            "Summarize the text for a busy manager in one short paragraph."))
        return f"{instr}\n\n{text}"
    q = rng.choice(questions)
    if rng.random() < 0.5:
        return f"Answer the question using only the text below.\n\nText: {text}\n\nQuestion: {q}"
    return f"Read the text and answer briefly: {q}\n\n{text}"


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w.capitalize() for w in rest)


def _finite_prompts(domain: str) -> list[str]:
    if domain == "code":
        return [t.format(name=n, js=_camel(n), args=a, desc=d) for t in _CODE_TEMPLATES for n, a, d in _CODE_SUBJECTS]
    if domain == "chat":
        return [t.format(x=x) for t, slots in _CHAT_SLOTS for x in slots]
    if domain == "translation":
        return [t.format(lang=lang, s=s) for t in _TRANSLATION_TEMPLATES for lang in _LANGUAGES for s in _SENTENCES]
    raise AssertionError(domain)


def _random_prompts(domain: str, rng: random.Random) -> Iterator[str]:
    make = _math_problem if domain == "math" else _summarization_prompt
    seen: set[str] = set()
    misses = 0
    while misses < 10_000:
        text = make(rng)
        if text in seen:
            misses += 1
            continue
        seen.add(text)
        yield text


def domain_prompts(domain: str, n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` distinct training prompts ``(id, text)`` of a domain, deterministic given ``seed``.

    The first ``n`` prompts of a larger request are the same (ids ``DOMAIN-sSEED-NNNN``), so a
    distilled set can be extended. Code, chat and translation are shuffled template x slot
    products (400, 164 and 576 prompts); math and summarization draw numbers and passages.
    """
    if domain not in DOMAINS:
        raise ConfigError(f"unknown training domain {domain!r}: use one of {', '.join(DOMAINS)}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"number of prompts must be an integer >= 1, got {n!r}")
    rng = random.Random(f"adaspec-train:{domain}:{seed}")
    if domain in ("math", "summarization"):
        texts: list[str] = []
        for text in _random_prompts(domain, rng):
            texts.append(text)
            if len(texts) == n:
                break
        if len(texts) < n:
            raise ConfigError(f"domain {domain!r} could only make {len(texts)} distinct prompts: ask for fewer")
    else:
        pool = _finite_prompts(domain)
        if n > len(pool):
            raise ConfigError(f"domain {domain!r} has {len(pool)} distinct training prompts, {n} were asked "
                              f"for: use --n {len(pool)} or less")
        rng.shuffle(pool)
        texts = pool[:n]
    return [(f"{domain}-s{seed}-{i:04d}", t) for i, t in enumerate(texts)]


def read_prompt_file(path: str | Path) -> list[tuple[str, PromptInput]]:
    """Prompts from a file: JSON lines with ``text`` or ``turns`` (and ``id`` or ``question_id``),
    or plain text with one prompt per line. Only the first turn of a multi-turn prompt is used
    (later turns depend on the target's own earlier answers)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise PromptError(f"prompt file not found: {path}: pass a .jsonl or .txt file")
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[tuple[str, PromptInput]] = []
    if path.suffix.lower() in (".jsonl", ".json"):
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise PromptError(f"{path}:{i}: not valid JSON ({exc}): one JSON object per line") from exc
            if not isinstance(row, dict):
                raise PromptError(f"{path}:{i}: expected a JSON object with 'text' or 'turns'")
            pid = str(row.get("id", row.get("question_id", f"{path.stem}-{i:04d}")))
            text = row.get("text")
            if text is None and isinstance(row.get("turns"), list) and row["turns"]:
                text = row["turns"][0]
            if not isinstance(text, str) or not text.strip():
                raise PromptError(f"{path}:{i}: needs a non-empty 'text' or 'turns' list of strings")
            out.append((pid, text))
    else:
        out = [(f"{path.stem}-{i:04d}", line.strip()) for i, line in enumerate(lines, 1) if line.strip()]
    if not out:
        raise PromptError(f"{path} holds no prompts")
    return out


# =============================================================================================
# The distilled-set format
# =============================================================================================
@dataclass
class Sample:
    """One target response: the prompt's and the response's token ids and how it was sampled."""

    prompt_id: str
    temperature: float
    seed: int
    prompt_ids: list[int]
    output_ids: list[int]

    @property
    def key(self) -> tuple[str, float, int]:
        return (self.prompt_id, float(self.temperature), int(self.seed))

    def to_json(self) -> str:
        return json.dumps({"prompt_id": self.prompt_id, "temperature": float(self.temperature),
                           "seed": int(self.seed), "prompt_ids": self.prompt_ids,
                           "output_ids": self.output_ids}, separators=(",", ":"))


@dataclass
class DistilledSet:
    """A loaded distilled directory: ``meta.json`` and the samples in file order."""

    path: Path
    meta: dict[str, Any]
    samples: list[Sample] = field(default_factory=list)

    @property
    def domain(self) -> str:
        return str(self.meta["domain"])

    @property
    def target(self) -> dict[str, Any]:
        return dict(self.meta["target"])

    @property
    def n_output_tokens(self) -> int:
        return sum(len(s.output_ids) for s in self.samples)

    def check_target(self, target: LoadedModel) -> None:
        """Raise ``ModelLoadError`` unless ``target`` is the model the responses came from."""
        check_fingerprint(self.target, target, f"distilled set {self.path}")


def _bad(path: Path, msg: str) -> AdaspecError:
    return AdaspecError(f"{path}: {msg}")


def _read_meta(path: Path) -> dict[str, Any]:
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise AdaspecError(f"{path} is not a distilled set (no meta.json): create it with `adaspec distill`")
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise _bad(meta_file, f"not valid JSON ({exc}): delete the directory and distill again") from exc
    if not isinstance(meta, dict) or meta.get("format") != DISTILL_FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else None
        raise _bad(meta_file, f"format {got!r}, expected {DISTILL_FORMAT!r}: distill again with this adaspec")
    for key, kind in (("target", dict), ("domain", str), ("temperatures", list), ("max_new_tokens", int),
                      ("created", str), ("n_samples", int)):
        if not isinstance(meta.get(key), kind):
            raise _bad(meta_file, f"field {key!r} is missing or not a {kind.__name__}: distill again")
    return meta


def _parse_sample(row: Any) -> Sample:
    if not isinstance(row, dict):
        raise ValueError("not a JSON object")
    ids, out = row["prompt_ids"], row["output_ids"]
    for name, seq in (("prompt_ids", ids), ("output_ids", out)):
        if not isinstance(seq, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                for t in seq):
            raise ValueError(f"{name} must be a list of token ids")
    if not ids:
        raise ValueError("prompt_ids is empty")
    if not isinstance(row["prompt_id"], str) or isinstance(row["seed"], bool) or not isinstance(row["seed"], int):
        raise ValueError("prompt_id must be a string and seed an integer")
    return Sample(row["prompt_id"], float(row["temperature"]), int(row["seed"]), ids, out)


def _read_samples(path: Path, *, repair: bool) -> list[Sample]:
    """Samples of ``samples.jsonl``. Lines are written whole, newline included, so a last line
    without its newline is a torn write (a crash): with ``repair`` it is cut off with a warning
    (its sample is regenerated), otherwise it is an error."""
    file = path / "samples.jsonl"
    if not file.is_file():
        return []
    raw = file.read_bytes()
    complete = raw.rfind(b"\n") + 1  # bytes up to the last newline are whole lines
    samples: list[Sample] = []
    for i, line in enumerate(raw[:complete].split(b"\n")[:-1], 1):
        if not line.strip():
            continue
        try:
            samples.append(_parse_sample(json.loads(line)))
        except (ValueError, KeyError, TypeError) as exc:
            raise _bad(file, f"line {i}: bad sample ({exc}): the file is corrupt, distill again") from exc
    if raw[complete:].strip():
        if not repair:
            raise _bad(file, "the last line is incomplete (an interrupted run): rerun `adaspec distill` with "
                             "the same arguments to repair and finish it")
        log.warning("%s: dropping a torn last line (an interrupted write); its sample is regenerated", file)
        with open(file, "r+b") as fh:
            fh.truncate(complete)
    return samples


def load_distilled(path: str | Path, target: LoadedModel | None = None) -> DistilledSet:
    """Load and validate a distilled set; with ``target``, refuse data from another model."""
    path = Path(path).expanduser()
    meta = _read_meta(path)
    if target is not None:
        check_fingerprint(meta["target"], target, f"distilled set {path}")
    if not (path / "samples.jsonl").is_file():
        raise AdaspecError(f"{path} has no samples.jsonl: rerun `adaspec distill` with the same arguments")
    samples = _read_samples(path, repair=False)
    if len(samples) != meta["n_samples"]:
        raise AdaspecError(f"{path}: meta.json counts {meta['n_samples']} samples but samples.jsonl holds "
                           f"{len(samples)} (the run was interrupted): rerun `adaspec distill` with the same "
                           "arguments to finish it")
    seen: set[tuple[str, float, int]] = set()
    for s in samples:
        if s.key in seen:
            raise AdaspecError(f"{path}: sample {s.key} appears twice: the set is corrupt, distill again")
        seen.add(s.key)
    return DistilledSet(path, meta, samples)


def _write_meta(path: Path, meta: dict[str, Any]) -> None:
    tmp = path / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path / "meta.json")


# =============================================================================================
# Generation
# =============================================================================================
@dataclass
class DistillRun:
    """What one ``distill`` call did (the set itself is on disk)."""

    path: Path
    n_samples: int  # in the set after the run
    new_samples: int
    new_tokens: int  # output tokens generated by this run
    skipped: int  # samples already present (resume)
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def _eos_ids(target: LoadedModel) -> set[int]:
    from .engine import SpeculativeEngine

    return SpeculativeEngine(target, ["none"]).eos_ids()


def _encode(target: LoadedModel, prompts: Sequence[tuple[str, PromptInput]], chat_template: bool) -> list[list[int]]:
    from .engine import SpeculativeEngine

    engine = SpeculativeEngine(target, ["none"])
    out = []
    for pid, prompt in prompts:
        try:
            out.append(engine.encode_prompt(prompt, chat_template))
        except PromptError as exc:
            raise PromptError(f"prompt {pid!r}: {exc}") from None
    return out


def _cut(row: Sequence[int], eos: set[int]) -> list[int]:
    """Response tokens up to and including the first EOS (the rest is padding)."""
    out: list[int] = []
    for t in row:
        out.append(int(t))
        if t in eos:
            break
    return out


_NON_NEUTRAL = ("min_p", "top_h", "suppress_tokens", "begin_suppress_tokens", "bad_words_ids", "sequence_bias",
                "exponential_decay_length_penalty", "forced_bos_token_id", "forced_eos_token_id")


@torch.inference_mode()
def generate_batch(target: LoadedModel, prompt_ids: Sequence[Sequence[int]], temperature: float,
                   max_new_tokens: int, *, seed: int = 0, eos: set[int] | None = None,
                   pad_id: int | None = None) -> list[list[int]]:
    """The target's responses to a batch of tokenised prompts with one ``model.generate`` call:
    left padding and an attention mask; greedy (``temperature`` 0) or plain temperature sampling
    (no top-k / top-p / repetition penalty, so the data follow the distribution the engine
    verifies). Batched fp32 greedy decoding can differ from unbatched greedy decoding in rare
    near-ties (padding changes the kernels' reduction order): harmless for training data.
    """
    from transformers import GenerationConfig

    eos = _eos_ids(target) if eos is None else eos
    if pad_id is None:
        tok_pad = getattr(target.tokenizer, "pad_token_id", None) if target.tokenizer is not None else None
        pad_id = tok_pad if tok_pad is not None else (min(eos) if eos else 0)
    width = max(len(p) for p in prompt_ids)
    device = target.device
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompt_ids], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=device)
    model_gc = getattr(target.model, "generation_config", None)
    active = [k for k in _NON_NEUTRAL if getattr(model_gc, k, None) not in (None, [], {})]
    if active:
        log.warning("the model's generation config sets %s, which generate() applies to distillation: "
                    "clear them for data that follow the target's plain distribution", ", ".join(active))
    sample = temperature > 0
    gc = GenerationConfig(do_sample=sample, temperature=temperature if sample else None,
                          top_k=0 if sample else None, top_p=1.0 if sample else None,
                          typical_p=1.0 if sample else None, repetition_penalty=1.0, no_repeat_ngram_size=0,
                          max_new_tokens=max_new_tokens, min_new_tokens=0, num_beams=1,
                          pad_token_id=pad_id, eos_token_id=sorted(eos) if eos else None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = target.model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
    return [_cut(row, eos) for row in out[:, width:].tolist()]


def _batch_seed(seed: int, temperature: float, ids: Sequence[str]) -> int:
    return zlib.crc32(f"{seed}|{temperature}|{'|'.join(ids)}".encode())


def distill_run(target: LoadedModel, prompts: Sequence[tuple[str, PromptInput]], out_dir: str | Path, *,
                domain: str, temperatures: Sequence[float] = DEFAULT_TEMPERATURES,
                samples_per_temperature: int = 1, max_new_tokens: int = 128,
                batch_size: int = DEFAULT_BATCH_SIZE, seed: int = 0, chat_template: bool = True,
                progress: Progress | None = None) -> DistillRun:
    """``distill``, returning what the run did (samples, tokens, time) as well as the path."""
    t0 = time.perf_counter()
    out = Path(out_dir).expanduser()
    temps = [float(t) for t in temperatures]
    if not temps or any(not (t >= 0 and t == t) for t in temps) or len(set(temps)) != len(temps):
        raise ConfigError(f"temperatures must be distinct numbers >= 0 (0 = greedy), got {list(temperatures)}")
    for name, v in (("samples_per_temperature", samples_per_temperature), ("max_new_tokens", max_new_tokens),
                    ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"distill: {name} must be an integer >= 1, got {v!r}")
    if not isinstance(domain, str) or not domain.strip():
        raise ConfigError("distill: give the set a domain name, e.g. --domain code")
    if not prompts:
        raise PromptError("distill: no prompts given")
    pids = [p for p, _ in prompts]
    if len(set(pids)) != len(pids):
        dup = sorted({p for p in pids if pids.count(p) > 1})[:5]
        raise PromptError(f"distill: duplicate prompt ids {dup}: give every prompt its own id")
    encoded = _encode(target, prompts, chat_template)
    window = target.context_window
    for pid, ids in zip(pids, encoded):
        if window is not None and len(ids) + max_new_tokens > window:
            raise PromptError(f"prompt {pid!r} has {len(ids)} tokens, which with max_new_tokens={max_new_tokens} "
                              f"exceeds the context window ({window}): shorten it or lower --max-new-tokens")

    fingerprint = target_fingerprint(target)
    out.mkdir(parents=True, exist_ok=True)
    existing: list[Sample] = []
    if (out / "meta.json").is_file():
        meta = _read_meta(out)
        check_fingerprint(meta["target"], target, f"the distilled set in {out}")
        if meta["domain"] != domain:
            raise ConfigError(f"{out} holds domain {meta['domain']!r}, not {domain!r}: use another --out")
        if meta["max_new_tokens"] != max_new_tokens:
            raise ConfigError(f"{out} was distilled with max_new_tokens={meta['max_new_tokens']}, not "
                              f"{max_new_tokens}: use the same value to resume, or another --out")
        existing = _read_samples(out, repair=True)
        meta["temperatures"] = list(dict.fromkeys([*map(float, meta["temperatures"]), *temps]))
    elif (out / "samples.jsonl").is_file():
        raise AdaspecError(f"{out} has samples.jsonl but no meta.json: delete it or use another --out")
    else:
        meta = {"format": DISTILL_FORMAT, "target": fingerprint, "domain": domain, "temperatures": temps,
                "max_new_tokens": max_new_tokens, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(
                    timespec="seconds"), "n_samples": 0}
    by_id = dict(zip(pids, encoded))
    done: set[tuple[str, float, int]] = set()
    for s in existing:
        if s.prompt_id in by_id and s.prompt_ids != by_id[s.prompt_id]:
            raise ConfigError(f"{out}: prompt {s.prompt_id!r} encodes differently than when it was distilled "
                              "(the prompt set, tokenizer or chat-template setting changed): use another --out")
        done.add(s.key)
    meta["n_samples"] = len(existing)
    _write_meta(out, meta)

    # work: (temperature, sample seed) groups, prompts sorted by length (less padding)
    work: list[tuple[float, int, list[int]]] = []
    for t in temps:
        for k in range(1 if t == 0 else samples_per_temperature):
            todo = [i for i in range(len(prompts)) if (pids[i], t, seed + k) not in done]
            todo.sort(key=lambda i: (len(encoded[i]), i))
            for b in range(0, len(todo), batch_size):
                work.append((t, seed + k, todo[b: b + batch_size]))
    total = sum(len(w[2]) for w in work)
    requested = sum(len(prompts) * (1 if t == 0 else samples_per_temperature) for t in temps)
    eos = _eos_ids(target)
    n_new = n_tokens = 0
    stage = f"distilling {domain}"
    if progress is not None:
        progress(stage, 0, total)
    with open(out / "samples.jsonl", "a", encoding="utf-8") as fh:
        for t, s_seed, idx in work:
            outputs = generate_batch(target, [encoded[i] for i in idx], t, max_new_tokens,
                                     seed=_batch_seed(s_seed, t, [pids[i] for i in idx]), eos=eos)
            for i, o in zip(idx, outputs):
                fh.write(Sample(pids[i], t, s_seed, encoded[i], o).to_json() + "\n")
                n_tokens += len(o)
            fh.flush()
            os.fsync(fh.fileno())
            n_new += len(idx)
            meta["n_samples"] = len(existing) + n_new
            _write_meta(out, meta)
            if progress is not None:
                progress(stage, n_new, total)
    return DistillRun(out, len(existing) + n_new, n_new, n_tokens, requested - total,
                      time.perf_counter() - t0)


def distill(target: LoadedModel, prompts: Sequence[tuple[str, PromptInput]], out_dir: str | Path, *,
            domain: str, temperatures: Sequence[float] = DEFAULT_TEMPERATURES, samples_per_temperature: int = 1,
            max_new_tokens: int = 128, batch_size: int = DEFAULT_BATCH_SIZE, seed: int = 0,
            chat_template: bool = True, progress: Progress | None = None) -> Path:
    """Write the target's responses to ``prompts`` (``(id, text | messages | token ids)``) into the
    distilled set ``out_dir`` (format ``adaspec.distill/1``) and return its path.

    Each prompt is answered greedily (temperature 0, once) and ``samples_per_temperature`` times
    at every other temperature (MetaSD F.1), batched ``batch_size`` prompts per ``generate``
    call. Resumable: samples already in the set, keyed by (prompt id, temperature, seed), are
    skipped; every batch is appended and flushed, so a crash loses at most one batch. Resuming
    with another target, domain or ``max_new_tokens`` is an error. Sampled responses depend on
    the batch they were drawn in (one RNG stream per batch), so a resumed run is a valid sample
    but not bit-identical to an uninterrupted one.
    """
    return distill_run(target, prompts, out_dir, domain=domain, temperatures=temperatures,
                       samples_per_temperature=samples_per_temperature, max_new_tokens=max_new_tokens,
                       batch_size=batch_size, seed=seed, chat_template=chat_template, progress=progress).path


# =============================================================================================
# Domain retrieval datastores (REST style)
# =============================================================================================
@dataclass
class DatastoreInfo:
    path: Path
    documents: int
    tokens: int
    sources: list[str]


def build_datastore(distilled_dirs: Sequence[str | Path], out_file: str | Path, max_tokens: int = 1_000_000, *,
                    min_match: int = 2, target: LoadedModel | None = None) -> Path:
    """Write a suffix-drafter datastore (``suffix:datastore=FILE``) of the responses in the
    distilled sets; return its path.

    Responses only, not prompts: the drafter should propose what the *target* writes, the
    live request's own prompt is matched anyway, and our templated training prompts (with the
    chat template's system preamble) would add near-duplicate text that never occurs in
    held-out requests. Every sample is one document (EOS kept, so ends of answers are drafted
    too); samples of several temperatures weight frequent continuations. All sets must come from
    one target (and from ``target`` when given). Exceeding ``max_tokens`` is an error, not an
    eviction: raise it or use fewer sets.
    """
    return build_datastore_info(distilled_dirs, out_file, max_tokens, min_match=min_match, target=target).path


def build_datastore_info(distilled_dirs: Sequence[str | Path], out_file: str | Path, max_tokens: int = 1_000_000,
                         *, min_match: int = 2, target: LoadedModel | None = None) -> DatastoreInfo:
    """``build_datastore`` returning the document and token counts as well."""
    from .drafters.suffix import SuffixDatastore

    if not distilled_dirs:
        raise ConfigError("build_datastore needs at least one distilled set")
    sets = [load_distilled(d, target) for d in distilled_dirs]
    first = sets[0]
    for ds in sets[1:]:
        keys = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "weights")
        if any(ds.target.get(k) != first.target.get(k) for k in keys):
            raise ModelLoadError(f"distilled sets {first.path} and {ds.path} come from different targets: "
                                 "a datastore serves one target, build one per target")
    docs = [s.output_ids for ds in sets for s in ds.samples if len(s.output_ids) > min_match]
    n_tokens = sum(len(d) for d in docs)
    if n_tokens > max_tokens:
        raise ConfigError(f"the responses hold {n_tokens} tokens, more than max_tokens={max_tokens}: raise "
                          "max_tokens or build from fewer sets")
    store = SuffixDatastore(min_match=min_match, max_tokens=max_tokens)
    for doc in docs:
        store.add(doc)
    out = Path(out_file).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    store.save(tmp)
    # record where the datastore comes from in its header line (the loader ignores extra keys)
    lines = tmp.read_text(encoding="utf-8").split("\n", 1)
    header = json.loads(lines[0])
    header.update({"target": first.target, "sources": [str(ds.path) for ds in sets],
                   "domains": sorted({ds.domain for ds in sets}), "documents": len(docs), "tokens": n_tokens})
    tmp.write_text(json.dumps(header) + "\n" + (lines[1] if len(lines) > 1 else ""), encoding="utf-8")
    os.replace(tmp, out)
    return DatastoreInfo(out, len(docs), n_tokens, [str(ds.path) for ds in sets])


# =============================================================================================
# Commands (registered by cli.py)
# =============================================================================================
def rich_progress(console: Any) -> tuple[Any, Progress]:
    """A rich progress display and a ``progress(stage, done, total)`` callback feeding it."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn
    from rich.progress import TimeRemainingColumn

    bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
              TimeRemainingColumn(), console=console, transient=True)
    tasks: dict[str, Any] = {}

    def report(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = bar.add_task(stage, total=total)
        bar.update(tasks[stage], completed=done, total=total)

    return bar, report


def distill_command(
    domain: Annotated[str, typer.Option("--domain", help=f"training domain: {', '.join(DOMAINS)} (or a "
                                        "name for --prompts)")] = "code",
    n: Annotated[int, typer.Option("--n", "-n", help="number of generated domain prompts")] = 120,
    out: Annotated[str | None, typer.Option("--out", "-o", help="output directory (default: the adaspec cache, "
                                            "distill/MODEL/DOMAIN)")] = None,
    temperature: Annotated[list[float] | None, typer.Option("--temperature", "-t", help="sampling temperature, "
                           "repeatable (0 = greedy); default 0 and 0.7")] = None,
    prompts: Annotated[str | None, typer.Option("--prompts", help="prompt file instead of the generated "
                       "domain prompts: .jsonl with id/text or turns, or .txt with one prompt per line")] = None,
    model: Annotated[str, typer.Option("--model", "-m", help="target model")] = "smollm2",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="response length cap")] = 128,
    samples: Annotated[int, typer.Option("--samples", help="samples per non-zero temperature")] = 1,
    batch_size: Annotated[int, typer.Option("--batch-size", help="prompts per generate call")] = DEFAULT_BATCH_SIZE,
    seed: Annotated[int, typer.Option(help="seed of the prompts and of sampling")] = 0,
    no_chat_template: Annotated[bool, typer.Option("--no-chat-template", help="feed prompts as raw text")] = False,
    threads: Annotated[int, typer.Option(help="torch threads (1 is fastest on a busy shared machine)")] = 1,
) -> None:
    """Generate self-distillation data: the target's responses to a domain's prompts (resumable)."""
    from rich.console import Console

    from .models import cache_dir, load_model, torch_threads

    err = Console(stderr=True)
    try:
        with torch_threads(threads):
            chosen = read_prompt_file(prompts) if prompts else domain_prompts(domain, n, seed)
            folder = Path(out) if out else cache_dir() / "distill" / Path(model).name / domain
            err.print(f"loading {model} ...")
            target = load_model(model)
            bar, report = rich_progress(err)
            with bar:
                run = distill_run(target, chosen, folder, domain=domain,
                                  temperatures=temperature or DEFAULT_TEMPERATURES, samples_per_temperature=samples,
                                  max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed,
                                  chat_template=not no_chat_template, progress=report)
    except AdaspecError as exc:
        err.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from None
    print(f"{run.path}: {run.n_samples} samples ({run.new_samples} new, {run.skipped} already there); "
          f"{run.new_tokens} tokens in {run.seconds:.1f} s ({run.tokens_per_s:.1f} tokens/s)")


def datastore_command(
    data: Annotated[list[str], typer.Argument(help="distilled set directories")],
    out: Annotated[str, typer.Option("--out", "-o", help="datastore file (.jsonl)")],
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="size bound of the datastore")] = 1_000_000,
    min_match: Annotated[int, typer.Option("--min-match", help="shortest suffix match")] = 2,
) -> None:
    """Build a suffix-drafter datastore from distilled sets (use it with -d suffix:datastore=FILE)."""
    from rich.console import Console

    err = Console(stderr=True)
    try:
        info = build_datastore_info(data, out, max_tokens, min_match=min_match)
    except AdaspecError as exc:
        err.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from None
    print(f"{info.path}: {info.documents} documents, {info.tokens} tokens; use it with "
          f"-d suffix:datastore={info.path}")
