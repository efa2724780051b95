"""Training prompts per domain for self-distillation (``adaspec distill``, ``adaspec build-pool``).

MetaSD F.1 distils each specialised drafter from the target's responses to prompts of its task.
The prompts are ours: templates x slot lists, seeded arithmetic problems and passages, plus
hand-written material in ``adaspec/data/training/*.json`` (questions, tasks, code to edit,
passages with questions, sentences to translate, math problems). Every set is deterministic given a seed and
shares no 8-word run with the benchmark suites in ``adaspec/data/prompts`` (a test checks it),
so evaluating drafters on those suites is held out.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from importlib import resources
from typing import Any

from ..errors import ConfigError

DOMAINS: tuple[str, ...] = ("code", "math", "chat", "summarization", "translation")


# -- templates and slot lists --------------------------------------------------------------------
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


# -- hand-written material (adaspec/data/training) -----------------------------------------------
_LANGUAGES_OUT = ("French", "Spanish", "German", "Italian", "Portuguese")
_INTO_ENGLISH: tuple[str, ...] = (
    "Translate this {lang} sentence into English: {s}",
    "What does this mean in English? \"{s}\"",
    "Translate into English:\n\n{s}",
    "Please give me an English translation of this {lang} text: '{s}'",
)
_PARAGRAPH_TEMPLATES: tuple[str, ...] = (
    "Translate the following text into {lang}:\n\n{s}",
    "Translate this short text into {lang}, keeping the meaning and the tone:\n\n'{s}'",
)
_EDIT_TASKS: tuple[str, ...] = (
    "Proofread the following text and fix every spelling and grammar mistake:",
    "Rewrite this paragraph in a more formal tone:",
    "Make this text shorter and clearer, keeping the key information:",
    "Rewrite this message so that it sounds friendlier:",
    "Turn the following paragraph into three bullet points:",
    "Improve the style of this paragraph and explain your main changes:",
)
_SUMMARY_TASKS: tuple[str, ...] = (
    "Summarize the following text in two sentences.",
    "Write a short summary of this article for a newsletter.",
    "What are the main points of the text below? Answer with bullet points.",
    "Give the passage below a title and a summary of about 50 words.",
    "Summarize this text in one sentence.",
    "Explain the text below in simple words for a twelve-year-old.",
    "Summarize the key facts and numbers in this report.",
    "Read this and tell me briefly what happened.",
)
_QA_FORMS: tuple[str, ...] = (
    "Answer the question using only the text below.\n\nText: {text}\n\nQuestion: {q}",
    "Read the text and answer briefly: {q}\n\n{text}",
    "{text}\n\nBased only on the text above: {q}",
)
_RAG_FORMS: tuple[str, ...] = (
    "{instruction}\n\n{passages}\n\nQuestion: {q}",
    "{instruction} {q}\n\n{passages}",
    "Context:\n{passages}\n\n{instruction}\nQuestion: {q}",
)
_EDIT_FORMS: tuple[str, ...] = ("{i}\n\n{code}", "{i}\n\n```{lang}\n{code}\n```",
                                "Here is some {lang} code:\n\n{code}\n\n{i}")


def material(name: str) -> dict[str, Any]:
    """One hand-written material file, ``adaspec/data/training/NAME.json``."""
    path = resources.files("adaspec") / "data" / "training" / f"{name}.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"training material {name}.json is missing or broken in the adaspec package ({exc}): "
                          "reinstall adaspec") from exc


def _code_sources() -> list[tuple[float, list[str]]]:
    m = material("code")
    tasks = [t.format(name=d["name"], js=_camel(d["name"]), args=d["args"], desc=d["desc"])
             for d in m["tasks"] for t in _CODE_TEMPLATES]
    edits = [form.format(i=i, code=sn["code"].strip("\n"), lang=sn.get("lang", "python"))
             for sn in m["snippets"] for i in m["edit_instructions"] for form in _EDIT_FORMS]
    old = [t.format(name=n, js=_camel(n), args=a, desc=d) for t in _CODE_TEMPLATES for n, a, d in _CODE_SUBJECTS]
    return [(0.35, tasks), (0.35, edits), (0.15, old), (0.15, list(m["questions"]))]


def _chat_sources() -> list[tuple[float, list[str]]]:
    m = material("chat")
    groups = [g["template"].format(x=x) for g in m["groups"] for x in g["slots"]]
    edits = [f"{task}\n\n{text}" for text in m["texts_to_edit"] for task in _EDIT_TASKS]
    old = [t.format(x=x) for t, slots in _CHAT_SLOTS for x in slots]
    return [(0.45, groups), (0.25, list(m["questions"])), (0.15, edits), (0.15, old)]


def _translation_sources() -> list[tuple[float, list[str]]]:
    """Into English from six languages, English sentences and paragraphs into five, and structured
    requests (JSON strings, subtitles, numbered steps, code comments, emails in a given register):
    plain sentence templates alone made a translation head no better than the generalist on
    requests shaped like real ones (bench ``translation``: 1.36 against 1.37 MAT@5)."""
    m = material("translation")
    foreign = material("translation_sources")
    english = [*_SENTENCES, *m["sentences"]]
    out_sentences = [t.format(lang=lang, s=s) for s in english for lang in _LANGUAGES_OUT
                     for t in _TRANSLATION_TEMPLATES]
    out_paragraphs = [t.format(lang=lang, s=p) for p in m["paragraphs"] for lang in _LANGUAGES_OUT
                      for t in _PARAGRAPH_TEMPLATES]
    into = [t.format(lang=lang, s=s) for lang, texts in foreign.items()
            for s in [*texts["sentences"], *texts["paragraphs"]] for t in _INTO_ENGLISH]
    structured = [f"{item['instruction'].replace('{lang}', lang)}\n\n{item['text']}" for item in m["structured"]
                  for lang in (_LANGUAGES_OUT if "{lang}" in item["instruction"] else ("",))]
    return [(0.35, into), (0.3, out_sentences), (0.1, out_paragraphs), (0.25, structured)]


def _math_sources(rng: random.Random) -> list[tuple[float, list[str]]]:
    """Hand-written problems (multi-step word problems, geometry, algebra, probability, concept
    questions) half of the time, seeded arithmetic problems the other half: seeded problems
    alone made a math head that learnt their few answer shapes and lost to the generalist on
    hand-written problems (bench ``math``: 1.73 against 1.77 MAT@5)."""
    return [(0.5, list(material("math")["problems"])), (0.5, _seeded("math", rng))]


def _rag_prompt(item: dict[str, Any], form: str) -> str:
    texts = item["passages"]
    passages = (f"Passage: {texts[0]}" if len(texts) == 1 else
                "\n\n".join(f"Passage {i}: {t}" for i, t in enumerate(texts, 1)))
    return form.format(instruction=item["instruction"], passages=passages, q=item["question"])


def _summarization_sources(rng: random.Random) -> list[tuple[float, list[str]]]:
    """Summaries of and questions over news-like passages and documents of many genres (meeting
    notes, email threads, incident reports, release notes, reviews, stories, recipes, manuals)
    with tasks written for each, multi-passage retrieval questions (some unanswerable or
    conflicting), and a few synthetic passages: mostly synthetic passages made a summarization
    head that lost to the generalist on the bench's summarization and RAG prompts."""
    m = material("summarization")
    passages, documents = m["passages"], m["documents"]
    summaries = [f"{task}\n\n{p['text']}" for p in passages for task in _SUMMARY_TASKS]
    questions = [form.format(text=p["text"], q=q) for p in passages for q in p["questions"] for form in _QA_FORMS]
    doc_tasks = [f"{task}\n\n{d['text']}" for d in documents for task in d["tasks"]]
    doc_questions = [form.format(text=d["text"], q=q) for d in documents for q in d["questions"]
                     for form in _QA_FORMS]
    rag = [_rag_prompt(item, form) for item in m["rag"] for form in _RAG_FORMS]
    return [(0.15, summaries), (0.1, questions), (0.3, doc_tasks), (0.1, doc_questions), (0.25, rag),
            (0.1, _seeded("summarization", rng))]


def _mix(sources: list[tuple[float, list[str]]], rng: random.Random) -> list[str]:
    """Every distinct prompt of the sources, in a seeded order that draws from each source in
    proportion to its weight (so a prefix of any length keeps the mix) until all are used."""
    queues = []
    for weight, texts in sources:
        texts = list(dict.fromkeys(texts))
        rng.shuffle(texts)
        queues.append((weight, texts[::-1]))  # pop() from the end
    seen: set[str] = set()
    out: list[str] = []
    while True:
        live = [(w, q) for w, q in queues if q]
        if not live:
            return out
        _, queue = rng.choices(live, weights=[w for w, _ in live])[0]
        text = queue.pop()
        if text not in seen:
            seen.add(text)
            out.append(text)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w.capitalize() for w in rest)


def _seeded(domain: str, rng: random.Random, n: int = 1000) -> list[str]:
    """The first ``n`` distinct generated prompts of a domain (math problems or passages)."""
    return list(itertools.islice(_random_prompts(domain, rng), n))


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
    distilled set can be extended. Every domain mixes, in fixed proportions, hand-written
    material with generated prompts: math (problems, and seeded arithmetic problems), code (new
    functions, code to edit, questions), chat (requests, questions, texts to edit),
    translation (into English from six languages, from English into five, and structured requests),
    summarization (summaries of and questions over passages and documents, multi-passage
    retrieval questions, and synthetic passages).
    """
    if domain not in DOMAINS:
        raise ConfigError(f"unknown training domain {domain!r}: use one of {', '.join(DOMAINS)}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"number of prompts must be an integer >= 1, got {n!r}")
    rng = random.Random(f"adaspec-train:{domain}:{seed}")
    sources = {"code": _code_sources, "chat": _chat_sources, "translation": _translation_sources}.get(domain)
    pool = _mix(sources() if sources is not None else
                (_math_sources if domain == "math" else _summarization_sources)(rng), rng)
    if n > len(pool):
        raise ConfigError(f"domain {domain!r} has {len(pool)} distinct training prompts, {n} were asked "
                          f"for: use --n {len(pool)} or less")
    texts = pool[:n]
    return [(f"{domain}-s{seed}-{i:04d}", t) for i, t in enumerate(texts)]
