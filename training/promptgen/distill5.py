"""distill5: more everyday assistant requests for self-distillation, with templates and topics not
used by distill4 (comparisons, step-by-step how-tos, pros and cons, definitions, short code in
several languages, Python standard-library questions about this machine's python3.11 modules,
advice, and rewriting of fortune sentences with new instructions). Deterministic (seed 5).
Nothing comes from an evaluation set, and prompts touching the topics of the bundled eval and
tune prompts are dropped so those stay unseen; so is every prompt of distill 1-4.

Reads: /usr/lib/python3.11 (Debian libpython3.11-stdlib), fortunes (Debian fortunes and
fortunes-min), the eval and tune prompts, the prompts of distill 1-4.

Written as JSONL ({"prompt": ...}) so that multi-line prompts (code to fix) stay one record.
(Was training/make-prompts5.)"""
import random

from .common import BANNED, fortune_quotes, jsonl_file, keep, python_lib


def generate(ctx):
    rng = random.Random(5)
    prompts = []

    # Comparisons.
    pairs = [("a cat", "a dog"), ("tea", "coffee"), ("a laptop", "a desktop computer"), ("renting a car", "taking the train"),
             ("a savings account", "a current account"), ("weather", "climate"), ("a lake", "a sea"), ("a frog", "a toad"),
             ("a crocodile", "an alligator"), ("a hurricane", "a tornado"), ("a novel", "a short story"), ("jam", "jelly"),
             ("baking soda", "baking powder"), ("RAM", "storage"), ("a router", "a modem"), ("HTTP", "HTTPS"),
             ("Python", "JavaScript"), ("a compiler", "an interpreter"), ("SQL", "NoSQL databases"), ("a stack", "a queue"),
             ("an array", "a linked list"), ("a process", "a thread"), ("a library", "a framework"), ("speed", "velocity"),
             ("mass", "weight"), ("a meteor", "a comet"), ("an ape", "a monkey"), ("a violin", "a viola"),
             ("a democracy", "a monarchy"), ("an email", "a letter"), ("walking", "running"), ("a bank", "a credit union"),
             ("a debit card", "a credit card"), ("an alligator", "a lizard"), ("a mushroom", "a plant"),
             ("a cold", "the flu"), ("a sprain", "a fracture"), ("a simile", "a metaphor"), ("a noun", "a verb"),
             ("an adjective", "an adverb"), ("a poem", "a song"), ("a village", "a town"), ("a river", "a stream")]
    tpl_cmp = ["What is the difference between {a} and {b}?", "Compare {a} and {b} in a short table.",
               "How are {a} and {b} alike, and how are they different?", "{A} or {b}: which should I choose, and why?"]
    for a, b in pairs:
        for t in rng.sample(tpl_cmp, 2):
            prompts.append(t.format(a=a, b=b, A=a[0].upper() + a[1:]))

    # Step-by-step how-tos.
    howtos = ["boil an egg", "tie a tie", "make a paper plane", "plant a tree", "clean a laptop keyboard",
              "write a CV", "set up a home Wi-Fi network", "make a budget spreadsheet", "iron a shirt", "wash a wool jumper",
              "bake bread at home", "make a cup of tea", "set a table for dinner", "paint a room", "hang a picture",
              "back up a phone", "create a strong password", "start a blog", "learn to swim as an adult",
              "prepare for a marathon", "make a to-do list that works", "organise a closet", "care for a cactus",
              "brew coffee with a French press", "sharpen a kitchen knife", "make a snowman", "write a haiku",
              "give a short speech", "apologise to a friend", "negotiate a salary", "train a dog to sit", "fold a fitted sheet",
              "remove a coffee stain", "change a light bulb safely", "unclog a sink", "make homemade pizza dough",
              "learn touch typing", "take a good photo with a phone", "read a nutrition label", "plan a road trip"]
    tpl_how = ["How do I {x}?", "Explain step by step how to {x}.", "What is the easiest way to {x}?",
               "Give me numbered steps to {x}."]
    for h in howtos:
        for t in rng.sample(tpl_how, 2):
            prompts.append(t.format(x=h))

    # Pros and cons, and opinions.
    choices = ["working from an office", "living in a big city", "living in the countryside", "electric scooters",
               "online shopping", "homeschooling", "a four-day work week", "public transport", "social media",
               "learning a second language", "owning a house", "freelancing", "studying abroad", "solar power",
               "video games for children", "e-books", "open-plan offices", "self-driving cars", "a gap year",
               "school uniforms", "nuclear energy", "smart speakers", "vegetarian diets", "cash payments"]
    tpl_pc = ["What are the pros and cons of {x}?", "List three advantages and three disadvantages of {x}.",
              "Is {x} a good idea? Give both sides."]
    for c in choices:
        for t in rng.sample(tpl_pc, 2):
            prompts.append(t.format(x=c))

    # Definitions and short facts.
    terms = ["an algorithm", "a metaphor", "a molecule", "an ecosystem", "a hypothesis", "a volcano", "a glacier",
             "a peninsula", "an equation", "a fraction", "a prime number", "a percentage", "an atom's nucleus",
             "an enzyme", "a hormone", "a neuron", "a galaxy", "a constellation", "a tsunami", "a desert",
             "a rainforest", "a mammal", "a reptile", "an insect", "a fungus", "a bacterium's cell wall", "a symphony",
             "a sonnet", "a biography", "a dictionary", "a museum", "a parliament", "a constitution", "an election",
             "a currency", "an export", "a loan", "interest rates", "a pension", "a spreadsheet", "a pixel", "a byte",
             "bandwidth", "a firewall", "a virus scanner", "a search engine", "a URL", "a cookie in a web browser",
             "a server", "a variable in programming", "a function in programming", "a loop in programming",
             "a bug in software", "an app", "a keyboard shortcut", "a file format", "a backup", "a cloud",
             "a thunderstorm", "humidity", "a heatwave", "erosion", "a fossil", "a mineral", "a magnet", "an echo"]
    tpl_def = ["What is {x}?", "Define {x} in one or two sentences.", "Give a simple definition of {x} and an example.",
               "Tell me three facts about {x}."]
    for x in terms:
        prompts.append(rng.choice(tpl_def).format(x=x))
        prompts.append(rng.choice(tpl_def).format(x=x))

    # Code in several languages.
    tasks = ["reverses a string", "checks whether a number is even", "finds the maximum of three numbers",
             "counts the vowels in a string", "returns the factorial of a number", "prints the numbers from 1 to 10",
             "checks whether a string is a palindrome", "returns the average of an array of numbers",
             "removes duplicates from an array", "converts Celsius to Fahrenheit", "returns the length of the longest word",
             "prints FizzBuzz up to 100", "sums the digits of a number", "checks whether a number is prime",
             "returns the last element of a list", "joins a list of words with commas", "counts the words in a sentence",
             "finds the smallest number in a list", "repeats a string n times", "returns the first n Fibonacci numbers"]
    langs = ["Python", "JavaScript", "Rust", "Go", "C", "Java", "C#", "Ruby", "PHP", "Kotlin", "Swift", "TypeScript"]
    for t in tasks:
        for l in rng.sample(langs, 3):
            prompts.append(f"Write a {l} function that {t}.")
    fixes = ["print('hello world'", "for i in range(10) print(i)", "x = [1, 2, 3]\nprint(x[3])", "def f(x):\nreturn x * 2",
             "if x = 5:\n    print(x)", "total = 0\nfor n in nums:\ntotal += n", "name = input('Name: ')\nprint('Hi ' + nme)",
             "import maths\nprint(maths.sqrt(4))", "d = {'a': 1}\nprint(d['b'])", "s = 'abc'\ns[0] = 'z'"]
    prompts += [f"Find and fix the bug in this Python code:\n{c}" for c in fixes]
    prompts += [f"What does this Python code print?\n{c}" for c in
                ["print(3 * 'ab')", "print(len('hello'))", "print([x * x for x in range(4)])", "print(10 // 3, 10 % 3)",
                 "print(sorted([3, 1, 2], reverse=True))", "print('a,b,c'.split(','))", "print(list(zip([1, 2], 'xy')))",
                 "print({1, 2, 2, 3})", "print(' hi '.strip().upper())", "print(sum(range(5)))"]]

    # Python standard-library modules installed on this machine.
    lib = python_lib()
    mods = sorted({p.stem for p in lib.glob("*.py") if p.stem.isidentifier() and not p.stem.startswith("_")}
                  | {p.name for p in lib.iterdir() if (p / "__init__.py").exists() and not p.name.startswith("_")})
    tpl_mod = ["What is the Python {m} module used for? Show a short example.", "Give me an example of using Python's {m} module.",
               "When would I use the {m} module in Python?"]
    prompts += [rng.choice(tpl_mod).format(m=m) for m in rng.sample(mods, min(150, len(mods)))]

    # Advice and chat.
    situations = ["I have an exam next week and I haven't started studying", "my houseplants keep dying",
                  "I keep forgetting to drink water", "my neighbour's dog barks all night", "I want to learn to cook",
                  "I spend too much money on takeaways", "I get headaches when I work at my computer",
                  "my child doesn't want to read", "I want to change careers", "I feel lonely after moving",
                  "I have too many emails", "my bike makes a clicking noise", "my phone battery drains fast",
                  "I can't decide what to study", "I want to write a book", "I have a job interview on Monday",
                  "my sourdough doesn't rise", "my laptop is slow", "I want to get fit at home", "my team misses deadlines",
                  "I want to start a small business", "I want to travel on a budget", "I have trouble waking up",
                  "my roommate never cleans", "I want to learn to draw", "I feel stressed about money"]
    tpl_adv = ["{s}. What should I do?", "{s}. Any advice?", "{s}. Can you give me a plan?"]
    for s in situations:
        for t in rng.sample(tpl_adv, 2):
            prompts.append(t.format(s=s))
    questions = ["What is the tallest mountain in the world?", "How long does it take light to reach Earth from the sun?",
                 "Why do we have leap years?", "How many bones are in the human body?", "What causes tides?",
                 "Why do cats land on their feet?", "How do bees communicate?", "What is the speed of sound?",
                 "Why do we sneeze?", "How are rainbows formed?", "What is the biggest animal on Earth?",
                 "How do vaccines train the immune system?", "Why is the sea salty but rivers are not?",
                 "How do plants know which way is up?", "Why do we get goosebumps?", "What makes popcorn pop?",
                 "How does a fridge magnet stick?", "Why does the moon look bigger near the horizon?",
                 "What is the oldest tree in the world?", "How do glasses help people see?"]
    prompts += questions

    # Rewriting fortune sentences with instructions distill4 did not use.
    quotes = fortune_quotes(["fortunes", "wisdom", "people", "work", "education", "food", "men-women", "platitudes", "love",
                             "literature", "politics", "science", "songs-poems", "computers", "pets", "sports",
                             "miscellaneous"], 160, plain=True)
    tpl_rw = ["Explain what this saying means: \"{q}\"", "Do you agree with this? Explain briefly: \"{q}\"",
              "Rewrite this as a tweet: \"{q}\"", "Rewrite this for a child: \"{q}\"",
              "Give a real-life example of this idea: \"{q}\"", "Turn this into a short poem: \"{q}\"",
              "Write a one-paragraph story inspired by: \"{q}\""]
    prompts += [rng.choice(tpl_rw).format(q=q) for q in rng.sample(sorted(set(quotes)), min(700, len(quotes)))]

    # Keep the bundled eval and tune prompts unseen, and skip what distill 1-4 already asked.
    seen = ctx.seen(["distill", "distill2", "distill3", "distill4"])
    prompts = keep(prompts, BANNED, ctx.held_out(), seen)
    rng.shuffle(prompts)
    return jsonl_file({"prompt": p} for p in prompts)
