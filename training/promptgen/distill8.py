"""distill8: an eighth batch of assistant requests for self-distillation, from sources and templates
distill 1-7 did not use: Python standard-library functions (names and first docstring lines read
from the running Python 3.11), paragraphs of Rust by Example, the Cargo book, the Rust reference
and the edition guide, and Rust compiler error codes (all from this machine's Rust toolchain
docs), and topic lists written here (comparisons, concepts, tips, plans, everyday writing in new
formats, small programs in several languages, questions about places, animals, jobs and money).
Deterministic (seed 8). Nothing comes from an evaluation set, and prompts touching the topics of
the bundled eval and tune prompts are dropped so those stay unseen; so is every prompt of
distill 1-7.

Reads: the running interpreter's standard library (must be Python 3.11: checked with Debian's
3.11.2 and 3.11.7), Rust 1.95.0's HTML docs (found by common.rust_docs), the eval and tune
prompts, the prompts of distill 1-7.

distill9 draws from what this set left unused: build() returns the pools as well as the prompts.
(Was training/make-prompts8; make-prompts9 exec'd its source up to a literal string to get them.)"""
import importlib
import inspect
import random
import types
import warnings

from .common import BANNED_WIDER, html_paragraphs, jsonl_file, keep, require_python_311, rust_docs


def build(ctx):
    """The kept prompts before the final shuffle, the pools they were drawn from, and the
    random generator in the state the shuffle starts from."""
    require_python_311("distill8")
    rng = random.Random(8)
    prompts = []

    # Python standard-library functions with a docstring.
    mods = ["string", "os.path", "json", "re", "itertools", "functools", "collections", "datetime", "math", "statistics",
            "random", "textwrap", "shutil", "pathlib", "csv", "urllib.parse", "heapq", "bisect", "operator", "glob", "fnmatch",
            "difflib", "base64", "hashlib", "copy", "pprint", "calendar", "time", "uuid", "zipfile", "tempfile", "html",
            "shlex", "secrets", "fractions", "decimal", "struct", "gzip", "subprocess", "logging", "argparse", "typing",
            "enum", "dataclasses", "contextlib", "threading", "queue", "socket", "sqlite3", "unicodedata"]
    funcs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m in mods:
            try:
                mod = importlib.import_module(m)
            except Exception:
                continue
            for name, obj in sorted(vars(mod).items()):
                if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
                    continue
                if getattr(obj, "__module__", m) not in (m, None) and not m.startswith(str(getattr(obj, "__module__", ""))):
                    continue
                doc = inspect.getdoc(obj) or ""
                if len(doc) > 20:
                    funcs.append((f"{m}.{name}", "class" if inspect.isclass(obj) else "function"))
    tpl_py = {
        "function": ["What does Python's `{x}` do? Show a short example.", "How do I use `{x}` in Python?",
                     "Give an example of `{x}` in Python and explain the output."],
        "class": ["What is `{x}` in Python used for? Show an example.", "Explain Python's `{x}` class with a short example."],
    }
    for x, kind in rng.sample(funcs, min(340, len(funcs))):
        prompts.append(rng.choice(tpl_py[kind]).format(x=x))

    # Paragraphs of four Rust books, and compiler error codes, from the toolchain's docs.
    base = rust_docs()
    paras = html_paragraphs([p for book in ["rust-by-example", "cargo", "reference", "edition-guide"]
                             for p in sorted((base / book).rglob("*.html")) if "print.html" not in p.name], 160, 400)
    codes = [p.stem for p in sorted((base / "error_codes").glob("E*.html"))]
    paras = sorted(set(paras))
    tpl_para = ["Explain this in plain English:\n\n{p}", "Summarise this for a new Rust programmer:\n\n{p}",
                "What does this paragraph mean? Give an example.\n\n{p}", "Turn this paragraph into three bullet points:\n\n{p}"]
    prompts += [rng.choice(tpl_para).format(p=p) for p in rng.sample(paras, min(320, len(paras)))]
    tpl_code = ["What does the Rust compiler error {x} mean, and how do I fix it?", "I got error {x} in Rust. What causes it?"]
    prompts += [rng.choice(tpl_code).format(x=c) for c in rng.sample(codes, min(70, len(codes)))]

    # Comparisons.
    pairs = [("weather", "climate"), ("a lake", "a pond"), ("a crocodile", "an alligator"), ("baking soda", "baking powder"),
             ("a list", "a tuple in Python"), ("RAM", "storage"), ("a loan", "a mortgage"), ("an app", "a website"),
             ("TCP", "UDP"), ("a comet", "an asteroid"), ("a poem", "a song"), ("speed", "velocity"), ("mass", "weight"),
             ("a democracy", "a republic"), ("a frog", "a toad"), ("jam", "jelly"), ("a hurricane", "a tornado"),
             ("HTTP", "HTTPS"), ("a git merge", "a git rebase"), ("stocks", "bonds"), ("an ocean", "a sea"),
             ("a rabbit", "a hare"), ("a violin", "a viola"), ("a simile", "a metaphor"), ("a fruit", "a vegetable"),
             ("a compiler", "an interpreter"), ("a process", "a thread"), ("a monkey", "an ape"), ("empathy", "sympathy"),
             ("a debit card", "a credit card"), ("a cold", "the flu"), ("a recession", "a depression"), ("latitude", "longitude"),
             ("a cafe", "a restaurant"), ("an essay", "a report"), ("a noun", "a verb"), ("JSON", "XML"), ("a star", "a planet"),
             ("a hill", "a mountain"), ("a village", "a town")]
    tpl_cmp = ["What is the difference between {a} and {b}?", "Compare {a} and {b} in a few sentences.",
               "How can I tell {a} from {b}?"]
    for a, b in pairs:
        prompts.append(rng.choice(tpl_cmp).format(a=a, b=b))

    # Concepts.
    concepts = ["gravity", "supply and demand", "compound interest", "evolution", "the water cycle", "democracy", "opportunity cost",
                "a black hole", "machine learning", "encryption", "the placebo effect", "recycling", "a food chain", "electricity",
                "magnetism", "an election", "a budget", "a time zone", "a leap year", "an eclipse", "the tides", "friction",
                "erosion", "a habitat", "a metaphor", "irony", "a hypothesis", "an algorithm", "recursion", "a database",
                "cloud computing", "open-source software", "a password manager", "two-factor authentication", "a cookie in a web browser",
                "version control", "a spreadsheet formula", "a carbon footprint", "biodiversity", "a vaccine", "sleep cycles",
                "calories", "muscle memory", "the scientific method", "a survey", "an average", "probability", "a percentage",
                "a fraction", "a prime number", "pi", "a triangle's angles", "the speed of sound", "an echo", "static electricity",
                "condensation", "a fossil", "a glacier", "a desert", "the seasons", "a constellation"]
    tpl_con = ["Explain {x} in simple terms.", "What is {x}? Give an everyday example.", "Explain {x} in three sentences.",
               "Why does {x} matter?"]
    for x in concepts:
        for t in rng.sample(tpl_con, 2):
            prompts.append(t.format(x=x))

    # Tips and advice.
    tips = ["sleeping better", "saving money on groceries", "learning a new language", "public speaking", "keeping a houseplant alive",
            "studying for an exam", "writing a CV", "a job interview", "running a first 5 km", "cooking for one",
            "keeping a tidy desk", "taking better photos with a phone", "travelling on a budget", "remembering names",
            "writing a good essay", "negotiating a salary", "training a puppy", "staying safe online", "moving to a new city",
            "starting a vegetable garden", "learning to swim as an adult", "drinking more water", "reducing screen time",
            "being a good listener", "planning a wedding", "teaching a child to read", "driving in snow", "packing light",
            "making a podcast", "learning to code", "painting a room", "meal planning for a week", "a long flight"]
    tpl_tip = ["Give me some tips for {x}.", "What are your best tips for {x}?", "I need advice on {x}. Where do I start?"]
    for x in tips:
        for t in rng.sample(tpl_tip, 2):
            prompts.append(t.format(x=x))

    # Plans and schedules.
    plans = ["a three-day trip to Rome", "a week of simple dinners", "a beginner's weekly workout", "a two-week study plan for a maths test",
             "a child's birthday party", "a day in London", "a productive Sunday", "a month of learning Spanish",
             "a picnic for six people", "a morning routine", "a road trip along the coast", "a book club meeting",
             "a small office party", "a weekend of spring cleaning", "a first week at a new job"]
    prompts += [f"Make a simple plan for {p}." for p in plans]
    prompts += [f"Help me plan {p}." for p in rng.sample(plans, 8)]

    # Everyday writing in formats distill 1-6 did not ask for.
    formats = ["a short review of", "a diary entry about", "a tweet about", "a short blog introduction about",
               "a two-sentence horror story about", "a dialogue between two friends about", "a short news report about",
               "a motivational quote about", "a riddle about", "a short advert for"]
    subjects = ["a new coffee shop", "a lost umbrella", "the first day of spring", "a power cut", "a school trip to a museum",
                "a talking parrot", "a broken lift", "a surprise party", "a long train delay", "a local football match",
                "a new library opening", "a snow day", "a village fair", "a robot vacuum cleaner", "an old map",
                "a missing cat", "a bake sale", "the last day of summer", "a city marathon", "a secret garden"]
    for f in formats:
        for s in rng.sample(subjects, 6):
            prompts.append(f"Write {f} {s}.")
    letters = ["a cover letter for a job as a library assistant", "a cover letter for a junior web developer job",
               "a letter of complaint about a noisy neighbour", "a reference for a former colleague",
               "an apology to a friend for missing their party", "an invitation to a book launch",
               "a note to a neighbour asking them to water my plants", "a resignation letter", "a thank-you letter to a nurse",
               "a letter to my future self", "a short bio for a conference speaker", "an out-of-office reply"]
    prompts += [f"Write {l}." for l in letters]

    # Small programs in several languages.
    tasks = ["checks whether a string is a palindrome", "counts the vowels in a string", "finds the largest number in an array",
             "reverses the words in a sentence", "returns the factorial of a number", "checks whether a year is a leap year",
             "converts Celsius to Fahrenheit", "removes duplicates from a list", "merges two sorted lists",
             "returns the nth Fibonacci number", "counts how often each word appears in a text", "checks whether a number is prime",
             "flattens a nested list", "finds the second smallest element in a list", "converts a number to binary",
             "validates that a password has at least eight characters and a digit", "computes the average of a list",
             "returns the longest word in a sentence", "rotates a list by k positions", "checks whether two strings are anagrams"]
    langs = ["Python", "JavaScript", "Rust", "Go", "C", "Java", "TypeScript", "Ruby", "C++", "Kotlin"]
    for t in tasks:
        for l in rng.sample(langs, 7):
            prompts.append(f"Write a {l} function that {t}.")
    prompts += [f"Explain how to {x} in Python." for x in ["read a CSV file", "make an HTTP request", "work with dates",
                "handle exceptions", "write a unit test", "use a virtual environment", "sort a dictionary by value",
                "format strings", "read command-line arguments", "write to a file", "use list comprehensions", "use a class"]]

    # Places, animals, jobs and money.
    places = ["Japan", "Iceland", "Kenya", "Peru", "Canada", "Norway", "Vietnam", "Morocco", "New Zealand", "Portugal",
              "Mexico", "Egypt", "Scotland", "Chile", "India", "Thailand"]
    tpl_place = ["Tell me three interesting facts about {x}.", "What is {x} known for?", "What should a first-time visitor to {x} know?"]
    for x in places:
        prompts.append(rng.choice(tpl_place).format(x=x))
    animals = ["octopuses", "elephants", "bees", "owls", "dolphins", "penguins", "ants", "bats", "sharks", "koalas",
               "wolves", "camels", "parrots", "tortoises", "frogs", "whales", "crows", "horses"]
    tpl_animal = ["Tell me some fun facts about {x}.", "How do {x} communicate?", "Where do {x} live and what do they eat?"]
    for x in animals:
        prompts.append(rng.choice(tpl_animal).format(x=x))
    jobs = ["a nurse", "an architect", "a pilot", "a software engineer", "a chef", "a librarian", "an electrician",
            "a vet", "a journalist", "a teacher", "a firefighter", "a data analyst", "a gardener", "a pharmacist"]
    tpl_job = ["What does {x} do all day?", "What skills do I need to become {x}?", "What are the pros and cons of working as {x}?"]
    for x in jobs:
        prompts.append(rng.choice(tpl_job).format(x=x))
    money = ["make a monthly budget", "start an emergency fund", "understand a payslip", "pay off a credit card",
             "save for a holiday", "choose a bank account", "avoid impulse buying", "explain taxes to a teenager"]
    prompts += [f"How do I {m}?" for m in money]

    # Keep the bundled eval and tune prompts unseen, and skip what distill 1-7 already asked.
    seen = ctx.seen(["distill", "distill2", "distill3", "distill4", "distill5", "distill6", "distill7"])
    prompts = keep(prompts, BANNED_WIDER, ctx.held_out(), seen)
    return types.SimpleNamespace(
        rng=rng, prompts=prompts, banned=BANNED_WIDER,
        funcs=funcs, tpl_py=tpl_py, paras=paras, tpl_para=tpl_para, codes=codes, tpl_code=tpl_code,
        concepts=concepts, tpl_con=tpl_con, places=places, tpl_place=tpl_place, animals=animals,
        tpl_animal=tpl_animal, jobs=jobs, tpl_job=tpl_job, tips=tips, tpl_tip=tpl_tip, pairs=pairs, tpl_cmp=tpl_cmp)


def generate(ctx):
    b = build(ctx)
    b.rng.shuffle(b.prompts)
    return jsonl_file({"prompt": p} for p in b.prompts)
