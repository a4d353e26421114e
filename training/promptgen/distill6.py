"""distill6: a sixth batch of assistant requests for self-distillation, from sources and templates
distill 1-5 did not use: Rust standard-library items and paragraphs of The Rust Programming
Language (both from this machine's Rust toolchain docs), everyday writing (emails, stories,
speeches, messages), how-things-work explanations, idea lists, small talk, SQL/shell/regex/HTML
tasks and grammar fixes. Deterministic (seed 6). Nothing comes from an evaluation set, and
prompts touching the topics of the bundled eval and tune prompts are dropped so those stay
unseen; so is every prompt of distill 1-5.

Reads: the Rust toolchain's HTML docs (Rust 1.95.0's, found by common.rust_docs; `rustup toolchain
install 1.95.0 --component rust-docs`), the eval and tune prompts, the prompts of
distill 1-5.

(Was training/make-prompts6.)"""
import random

from .common import BANNED_WIDER, html_paragraphs, jsonl_file, keep, rust_docs, rust_std_items


def generate(ctx):
    rng = random.Random(6)
    prompts = []

    # Rust standard-library items, from the toolchain's own docs (file names such as struct.Vec.html).
    items = rust_std_items()
    tpl_rust = {
        "struct": ["What is Rust's `{x}` used for? Show a short example.", "Explain `{x}` in Rust to a beginner."],
        "enum": ["What is the `{x}` enum in Rust? Give an example of matching on it."],
        "trait": ["What does the Rust trait `{x}` do, and how do I implement it?", "Explain the `{x}` trait in Rust with an example."],
        "fn": ["What does the Rust function `{x}` do? Show how to call it.", "Give an example of using `{x}` in Rust."],
        "macro": ["How do I use the `{x}!` macro in Rust?", "Explain Rust's `{x}!` macro with an example."],
    }
    for kind, x in rng.sample(sorted(items), min(170, len(items))):
        prompts.append(rng.choice(tpl_rust[kind]).format(x=x))

    # Paragraphs of The Rust Programming Language, to summarise or explain.
    paras = html_paragraphs(sorted((rust_docs() / "book").glob("ch*.html")), 180, 420)
    tpl_para = ["Summarise this paragraph in one sentence:\n\n{p}", "Explain this paragraph in simple words:\n\n{p}",
                "What is the main point of this paragraph?\n\n{p}", "Rewrite this paragraph for a complete beginner:\n\n{p}"]
    prompts += [rng.choice(tpl_para).format(p=p) for p in rng.sample(paras, min(150, len(paras)))]

    # Everyday writing.
    emails = ["my landlord about a broken heater", "my manager asking for a day off", "a colleague thanking them for their help",
              "a shop asking for a refund", "my child's school about a missed day", "a friend I have not seen in years",
              "a hotel asking about late check-in", "a client apologising for a delay", "a new team member welcoming them",
              "my gym cancelling my membership", "a neighbour about a parcel I took in", "a professor asking for an extension",
              "a plumber asking for a quote", "my team announcing a new meeting time", "a recruiter declining a job offer",
              "a library about a lost book", "a restaurant praising the service", "a supplier about a late delivery"]
    prompts += [f"Write a short email to {e}." for e in emails]
    prompts += [f"Write a polite message to {e}." for e in emails]
    stories = ["a robot who learns to paint", "a girl who finds a door in her garden", "a dragon who is afraid of fire",
               "an old fisherman and a talking fish", "a lost penguin in a big city", "two friends who build a treehouse",
               "a baker whose bread makes people honest", "a mouse who wants to be a pilot", "a clock that runs backwards",
               "a boy who can hear plants", "a cat who runs a post office", "a snowman who wants to see summer",
               "a knight who hates fighting", "a tiny island with one tree", "a detective who solves cases by smell",
               "a grandmother who was once an astronaut", "a library where the books talk at night", "a shy giant"]
    tpl_story = ["Write a short story about {x}.", "Tell me a bedtime story about {x}.", "Write the opening paragraph of a story about {x}."]
    for s in stories:
        for t in tpl_story:
            prompts.append(t.format(x=s))
    occasions = ["a friend's wedding", "a retirement party", "the first day of school", "a team that won a match",
                 "a charity fundraiser", "a graduation", "a colleague's leaving party", "a grandparent's 90th birthday"]
    prompts += [f"Write a short speech for {o}." for o in occasions]
    prompts += [f"Write a birthday message for {p}." for p in ["my sister", "my boss", "a five-year-old", "my best friend", "my grandfather"]]
    poem_topics = ["the sea at night", "a rainy Monday", "a city in winter", "an old oak tree", "the first snow", "a cup of coffee",
                   "a train journey", "the moon", "a busy kitchen", "spring flowers", "a mountain lake", "friendship"]
    tpl_poem = ["Write a haiku about {x}.", "Write a limerick about {x}.", "Write a short rhyming poem about {x}."]
    for x in poem_topics:
        for t in rng.sample(tpl_poem, 2):
            prompts.append(t.format(x=x))
    products = ["a wooden chopping board", "noise-cancelling headphones", "a hiking backpack", "a desk lamp", "a wool scarf",
                "an electric kettle", "a yoga mat", "a children's picture book", "a travel mug", "a houseplant pot"]
    prompts += [f"Write a short product description for {p}." for p in products]
    prompts += [f"Write a catchy slogan for {b}." for b in ["a bakery", "a bike repair shop", "a dentist", "a language school",
                                                           "a dog-walking service", "a bookshop", "a cleaning company"]]

    # How things work.
    things = ["a microwave oven", "a dishwasher", "GPS", "a battery", "a solar panel", "a car engine", "the human heart",
              "the lungs", "an elevator", "an escalator", "a printer", "a digital camera", "a thermostat", "a toaster",
              "a washing machine", "a touchscreen", "a 3D printer", "a wind turbine", "a telescope", "a microscope",
              "a traffic light", "a QR code", "a barcode scanner", "email", "the internet", "Bluetooth", "a smoke detector",
              "a vacuum cleaner", "a hot-air balloon", "a submarine", "a rocket", "a rainbow", "the immune system",
              "photosynthesis", "a volcano eruption", "an earthquake", "a hydroelectric dam", "a pressure cooker",
              "noise-cancelling headphones", "a credit card payment", "a search engine", "a spam filter"]
    tpl_work = ["How does {x} work?", "Explain how {x} works in simple terms.", "Explain {x} to a ten-year-old."]
    for x in things:
        for t in tpl_work:
            prompts.append(t.format(x=x))

    # Idea lists.
    ideas = ["a rainy day with kids", "a cheap date", "a team-building activity", "a birthday party theme", "a science fair project",
             "a new hobby", "a healthy snack", "a short weekend trip", "a gift for a teacher", "a podcast episode",
             "a garden in a small space", "a family game night", "a school fundraiser", "a first novel", "a mobile app",
             "a board game", "using leftover rice", "decorating a small flat", "saving energy at home", "a quiet evening"]
    tpl_ideas = ["Give me five ideas for {x}.", "List some ideas for {x}.", "Suggest three ideas for {x} and explain each briefly."]
    for x in ideas:
        for t in rng.sample(tpl_ideas, 2):
            prompts.append(t.format(x=x))
    lists = ["countries in South America", "famous painters", "musical instruments", "types of clouds", "kitchen tools",
             "programming languages", "bones in the human arm", "birds that cannot fly", "European capitals", "fruits high in vitamin C",
             "board games for families", "common job interview questions", "Greek gods", "famous inventors", "types of rock",
             "things to check before a long drive", "ways to say thank you", "units of length", "Olympic sports", "spices"]
    tpl_list = ["List {n} {x}.", "Name {n} {x}.", "Give me a list of {n} {x} with one fact about each."]
    for x in lists:
        for t in rng.sample(tpl_list, 2):
            prompts.append(t.format(n=rng.choice(["three", "five", "seven", "ten"]), x=x))

    # Recipes, history, rules of games.
    dishes = ["pancakes", "tomato soup", "a vegetable curry", "guacamole", "banana bread", "a Greek salad", "fried rice",
              "hummus", "a mushroom risotto", "lemonade", "chocolate chip cookies", "a cheese omelette", "spaghetti carbonara",
              "chili con carne", "a fruit smoothie", "roast potatoes", "a chicken stir-fry", "apple crumble", "porridge", "lentil soup"]
    tpl_dish = ["Give me a simple recipe for {x}.", "How do I make {x}?"]
    for d in dishes:
        prompts.append(rng.choice(tpl_dish).format(x=d))
    history = ["the printing press", "the Olympic Games", "the bicycle", "chess", "the telephone", "coffee", "the Roman Empire",
               "the Great Wall of China", "paper money", "the piano", "football", "the postal service", "the calendar", "chocolate",
               "the first computers", "the Eiffel Tower"]
    prompts += [f"Tell me briefly about the history of {h}." for h in history]
    games = ["chess", "tennis", "basketball", "poker", "cricket", "volleyball", "badminton", "Monopoly", "Scrabble", "rugby",
             "table tennis", "golf", "sudoku", "bowling"]
    prompts += [f"Explain the basic rules of {g}." for g in games]

    # Small talk and chat.
    prompts += ["Hi there! How are you today?", "Good morning! Any tips for a productive day?", "Tell me a fun fact.",
                "Tell me a joke about computers.", "Tell me a joke about cats.", "What should I cook tonight with eggs and spinach?",
                "What should I cook tonight with rice, beans and peppers?", "Recommend a book for someone who likes mysteries.",
                "Recommend a film for a family evening.", "I'm bored. What can I do?", "Can you help me plan my weekend?",
                "What's a good way to relax after work?", "Can you teach me a new word?", "What is your favourite season, and why?",
                "Do you have any tips for making friends as an adult?", "What are some good habits to start this year?",
                "I just got a puppy! What do I need to know?", "Can you recommend a board game for four people?",
                "What are some fun things to do in a new city?", "How can I be more patient?", "Thanks for your help!",
                "Can you explain what you are?", "What questions can I ask you?", "Say something encouraging.",
                "What's a good question to start a conversation?", "How do I say no politely?"]

    # Code: SQL, shell, regular expressions, HTML/CSS, small Python classes and code reading.
    sql = ["counts the orders for each product", "finds the three most expensive products", "lists employees hired after 2020",
           "joins a table of books with a table of authors", "deletes rows where the email is empty", "updates a user's password field",
           "finds duplicate email addresses in a users table", "shows the average salary per department",
           "creates a table for storing blog posts", "selects students with a grade above 90"]
    prompts += [f"Write a SQL query that {s}." for s in sql]
    shell = ["counts the files in a directory", "finds all .txt files larger than 1 MB", "shows the ten largest folders",
             "renames every .jpeg file to .jpg", "prints the last 20 lines of a log file", "searches for a word in all Python files",
             "shows which process uses a port", "compresses a folder into a tar.gz file", "shows disk usage in a readable format"]
    prompts += [f"Write a shell command that {s}." for s in shell]
    regex = ["an email address", "a UK postcode", "a date like 2024-05-31", "a phone number with 10 digits", "a hex colour like #a1b2c3",
             "a word that starts with a capital letter", "an IPv4 address", "a time like 14:30"]
    prompts += [f"Write a regular expression that matches {r}, and explain it." for r in regex]
    web = ["a simple contact form", "a navigation bar with three links", "a two-column layout", "a button that changes colour on hover",
           "a table of three fruits and their prices", "a centred heading and paragraph", "an image with a caption"]
    prompts += [f"Write the HTML and CSS for {w}." for w in web]
    classes = ["a bank account with deposit and withdraw", "a shopping cart", "a to-do list", "a simple timer", "a rectangle with area and perimeter",
               "a library book with a due date", "a student with grades", "a temperature converter", "a deck of cards", "a queue"]
    prompts += [f"Write a Python class for {c}." for c in classes]
    snippets = ["nums = [4, 1, 3]\nnums.sort()\nprint(nums[0])", "words = 'a b c'.split()\nprint(len(words))",
                "d = {}\nfor ch in 'hello':\n    d[ch] = d.get(ch, 0) + 1\nprint(d)", "x = 5\nwhile x > 0:\n    x -= 2\nprint(x)",
                "def add(a, b=2):\n    return a + b\nprint(add(3))", "s = 'Python'\nprint(s[::-1])",
                "print([n for n in range(10) if n % 3 == 0])", "a, b = 1, 2\na, b = b, a\nprint(a, b)",
                "import math\nprint(math.floor(3.7), math.ceil(3.2))", "print(' '.join(['Hello', 'there']))"]
    prompts += [f"Explain what this Python code does:\n{c}" for c in snippets]

    # Grammar fixes and tone changes on sentences written here.
    sentences = ["me and him goes to the shop yesterday", "their going to there house tonight", "i has finished my homework",
                 "the dog wagged it's tail", "she don't like apples", "we was late for the meeting", "less people came than expected",
                 "who's book is this", "the data shows that sales has increased", "between you and I, the plan is bad",
                 "I could of helped you", "the team are winning there games", "irregardless of the weather we will go",
                 "she gave the present to my brother and I", "if I was you I would call her"]
    tpl_fix = ["Correct the grammar in this sentence: \"{s}\"", "Fix the mistakes: \"{s}\""]
    prompts += [rng.choice(tpl_fix).format(s=s) for s in sentences]
    tone = ["We need the report by Friday.", "Your order is late because of a problem in our warehouse.",
            "The meeting is cancelled.", "Please stop parking in front of my garage.", "I can't come to your party.",
            "The price will go up next month.", "You made a mistake in the invoice.", "We have decided to hire another candidate."]
    tpl_tone = ["Make this more formal: \"{s}\"", "Make this friendlier: \"{s}\"", "Rewrite this more diplomatically: \"{s}\""]
    for s in tone:
        for t in rng.sample(tpl_tone, 2):
            prompts.append(t.format(s=s))

    # Keep the bundled eval and tune prompts unseen, and skip what distill 1-5 already asked.
    seen = ctx.seen(["distill", "distill2", "distill3", "distill4", "distill5"])
    prompts = keep(prompts, BANNED_WIDER, ctx.held_out(), seen)
    rng.shuffle(prompts)
    return jsonl_file({"prompt": p} for p in prompts)
