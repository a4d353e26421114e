"""distill4: everyday assistant requests (explanations, writing, code, lists, rewriting, chat) for
self-distillation, from topic lists written here and sentences from this machine's fortune files.
Deterministic (seed 4). Written for selfspec; nothing comes from an evaluation set, and prompts
touching the topics of the bundled eval and tune prompts are dropped so those stay unseen.

Reads: fortunes (Debian fortunes and fortunes-min), the eval and tune prompts.

(Was training/make-prompts4; the file's comment line still names it.)"""
import random

from .common import BANNED, fortune_quotes, keep, text_file


def generate(ctx):
    rng = random.Random(4)
    prompts = []

    # How things work, and why things happen.
    devices = ["microwave oven", "washing machine", "smoke detector", "thermostat", "electric kettle", "solar panel",
               "wind turbine", "battery", "light bulb", "LED", "camera", "telescope", "microscope", "loudspeaker",
               "microphone", "touch screen", "barcode scanner", "GPS receiver", "Wi-Fi router", "hard drive", "USB stick",
               "printer", "vacuum cleaner", "air conditioner", "heat pump", "elevator", "escalator", "lock and key",
               "zipper", "pressure cooker", "dishwasher", "electric car", "hybrid car", "train brake", "submarine",
               "hot-air balloon", "parachute", "rocket", "satellite", "radio", "television", "mobile phone",
               "credit card", "vaccine", "thermometer", "water filter", "sewing machine", "piano", "bicycle gear",
               "traffic light", "dam", "lighthouse lamp", "nuclear power plant", "electric guitar", "mechanical watch"]
    whys = ["do leaves change colour in autumn", "do we have seasons", "does ice float on water", "do cats purr",
            "do we dream", "does bread go stale", "do onions make people cry", "is the ocean salty", "do stars twinkle",
            "do we get hiccups", "does metal feel colder than wood", "do birds migrate", "does the moon change shape",
            "do we need sleep", "do bubbles pop", "does thunder follow lightning", "do rainbows form",
            "do some people need glasses", "does popcorn pop", "do we yawn", "does coffee keep people awake",
            "do apples turn brown when cut", "do bees make honey", "does the wind blow", "do volcanoes erupt",
            "do earthquakes happen", "do we have fingerprints", "does salt melt ice", "do mirrors reverse left and right",
            "do babies sleep so much"]
    concepts = ["gravity", "photosynthesis", "evolution", "electricity", "magnetism", "the water cycle", "climate change",
                "compound interest", "supply and demand", "democracy", "the immune system", "black holes", "atoms",
                "the internet", "encryption", "machine learning", "a blockchain", "recycling", "the greenhouse effect",
                "plate tectonics", "the digestive system", "sound waves", "friction", "a budget", "taxes", "insurance",
                "a mortgage", "the stock market", "vitamins", "protein", "calories", "memory in the brain", "antibiotics",
                "an operating system", "a database", "cloud computing", "open-source software", "a compiler",
                "recursion", "an API", "version control", "a web browser", "email", "a password manager"]
    tpl_how = ["How does a {x} work?", "Explain how a {x} works in simple terms.", "Describe the main parts of a {x}.",
               "Explain to a child how a {x} works."]
    tpl_concept = ["Explain {x} in simple terms.", "What is {x}? Give an everyday example.", "Explain {x} to a twelve-year-old.",
                   "Summarise what {x} is in three sentences.", "What are the key ideas behind {x}?"]
    prompts += [t.format(x=d) for d in devices for t in rng.sample(tpl_how, 2)]
    prompts += [f"Why {w}?" for w in whys]
    prompts += [t.format(x=c) for c in concepts for t in rng.sample(tpl_concept, 3)]

    # Writing tasks.
    occasions = ["a birthday party", "a farewell lunch for a colleague", "a book club meeting", "a charity run",
                 "a garage sale", "a school concert", "a team dinner", "a picnic in the park", "a board game night",
                 "a community clean-up", "a cooking class", "a housewarming", "a film night", "a chess tournament"]
    prompts += [f"Write a short, friendly invitation to {o}." for o in occasions]
    prompts += [f"Write a short announcement for {o}." for o in rng.sample(occasions, 8)]
    poem_topics = ["the sea", "winter mornings", "a city at night", "friendship", "rain", "a lost key", "mountains",
                   "a cup of tea", "the first day of school", "an old dog", "spring flowers", "the moon", "a long train ride",
                   "snow", "the desert", "a garden", "time", "a river", "home", "a summer storm"]
    forms = ["a four-line poem", "a haiku", "a short rhyming poem", "a limerick"]
    prompts += [f"Write {rng.choice(forms)} about {t}." for t in poem_topics for _ in range(3)]
    products = ["a backpack", "a desk lamp", "noise-cancelling headphones", "a yoga mat", "a coffee grinder", "running shoes",
                "a phone case", "a notebook", "an umbrella", "a wooden chess set", "a travel pillow", "a smartwatch",
                "a cast-iron pan", "a bicycle helmet", "a houseplant pot", "a board game"]
    prompts += [f"Write a product description for {p}." for p in products]
    prompts += [f"Write a short advertisement for {p}." for p in rng.sample(products, 8)]
    letters = ["a thank-you email to a colleague who helped with a project", "a short apology for missing a meeting",
               "a message asking a landlord to fix a leaking tap", "a note congratulating a friend on a new job",
               "an email asking for a day off", "a complaint about a late delivery", "a reference request to a former teacher",
               "a welcome message for a new team member", "a reminder about an unpaid invoice", "a get-well-soon card",
               "a short speech for a friend's wedding", "a message cancelling a dinner reservation",
               "an out-of-office reply", "a request for a meeting with a manager", "a short bio for a conference speaker"]
    prompts += [f"Write {l}." for l in letters]
    story_seeds = ["a robot who learns to paint", "a lost cat finding its way home", "a child who discovers a secret door",
                   "a baker who wins a contest", "two friends on a road trip", "a dragon afraid of the dark",
                   "a detective solving a small mystery", "a girl who can talk to birds", "a town where it never rains",
                   "an astronaut's first day on Mars", "a wizard who forgets his spells", "a boy and his kite"]
    prompts += [f"Write a very short story about {s}." for s in story_seeds]

    # Code (mostly Python, the language users ask about most).
    py_tasks = ["returns the second largest number in a list", "counts how often each word appears in a string",
                "checks whether two strings are anagrams", "flattens a nested list", "finds the common elements of two lists",
                "converts a list of tuples into a dictionary", "removes all punctuation from a string",
                "returns the median of a list of numbers", "generates a random password", "checks whether a year is a leap year",
                "converts a number to binary", "rotates a list by k positions", "capitalises every sentence in a text",
                "groups a list of words by their first letter", "computes the greatest common divisor of two numbers",
                "reads a CSV file and prints the first five rows", "writes a list of strings to a file, one per line",
                "merges two dictionaries", "finds the longest word in a sentence", "checks whether a list is sorted",
                "computes simple interest", "returns the n-th prime number", "splits a list into chunks of size n",
                "counts the uppercase letters in a string", "converts minutes to hours and minutes",
                "returns the unique values of a list in order", "computes the area of a circle", "implements binary search",
                "implements bubble sort", "parses a date string like 2024-01-31", "validates a phone number",
                "returns the frequency of each character in a string", "builds a multiplication table",
                "finds the index of the minimum value in a list", "reverses the words in a sentence"]
    prompts += [f"Write a Python function that {t}." for t in py_tasks]
    other = [("JavaScript", "filters the even numbers out of an array"), ("JavaScript", "debounces a function"),
             ("Rust", "returns the largest value in a vector"), ("C", "swaps two integers using pointers"),
             ("Go", "reads a file and counts its lines"), ("Java", "checks whether a string is empty"),
             ("Bash", "renames all .txt files in a folder to .md"), ("TypeScript", "types a user object with a name and age")]
    prompts += [f"Write a {l} function that {t}." for l, t in other]
    sql = ["selects all orders placed in 2023 from a table called orders",
           "counts the number of employees in each department from a table called employees",
           "finds the ten most expensive products in a table called products",
           "lists the names of students older than 18 from a table called students",
           "deletes all rows with a NULL email from a table called users",
           "joins a table of authors with a table of books on author_id", "computes the average salary per city",
           "finds duplicate email addresses in a table called accounts"]
    prompts += [f"Write a SQL query that {q}." for q in sql]
    py_concepts = ["a while loop", "a list comprehension", "a dictionary", "a class", "exceptions", "a lambda function",
                   "slicing", "a generator", "a decorator", "f-strings", "the with statement", "a tuple", "a set",
                   "default arguments", "modules and imports", "recursion", "the range function", "string methods",
                   "reading user input", "virtual environments"]
    prompts += [f"Explain {c} in Python, with an example." for c in py_concepts]
    prompts += ["What is the difference between a list and a tuple in Python?", "What is the difference between == and is in Python?",
                "How do I install a Python package with pip?", "How do I read a JSON file in Python?",
                "What does 'git commit' do?", "How do I undo the last git commit?", "What is an HTTP status code?",
                "What is the difference between HTML and CSS?", "What does a REST API do?", "How do I find a bug in my code?"]

    # Lists.
    goals = ["save energy at home", "improve your sleep", "be more productive at work", "make a small kitchen tidier",
             "reduce stress", "eat more vegetables", "save money on groceries", "learn new words", "make a room feel cosier",
             "help the environment", "stay safe online", "prepare for a job interview", "keep a conversation going",
             "spend less time on your phone", "make new friends", "stay cool in hot weather", "stay warm in winter",
             "look after a puppy", "keep your car in good shape", "read faster", "remember names", "start a vegetable garden",
             "make a long flight comfortable", "keep children busy on a rainy day", "write better notes in class"]
    nums = ["three", "four", "five", "six", "seven"]
    prompts += [f"List {rng.choice(nums)} ways to {g}." for g in goals]
    prompts += [f"Give me {rng.choice(nums)} tips to {g}." for g in goals]
    enumerations = ["the continents", "the days of the week in French", "the primary colours", "the oceans of the world",
                    "the months of the year with their number of days", "the noble gases", "the bones of the arm",
                    "common kitchen herbs", "the layers of the Earth", "the parts of a flower", "the stages of sleep",
                    "famous painters of the Renaissance", "common programming languages and what they are used for",
                    "the seven wonders of the ancient world", "the phases of the moon", "the parts of a cell",
                    "common types of clouds", "the branches of science", "popular dog breeds", "musical instruments in an orchestra"]
    prompts += [f"List {e}." for e in enumerations]
    packing = ["a beach holiday", "a business trip", "a ski weekend", "a hospital stay", "a long hike", "a music festival",
               "a first day at university", "moving to a new flat"]
    prompts += [f"Make a checklist for {p}." for p in packing]
    recipes = ["pancakes", "tomato pasta", "a green salad", "banana bread", "fried rice", "lentil soup", "an omelette",
               "guacamole", "a fruit smoothie", "roast potatoes", "a simple curry", "chocolate chip cookies"]
    prompts += [f"Give me a simple recipe for {r}." for r in recipes]

    # Rewriting: sentences from the fortune files, and sentences written here.
    quotes = fortune_quotes(["fortunes", "wisdom", "people", "work", "education", "food", "men-women", "platitudes",
                             "love"], 140, plain=True)
    tpl_rw = ["Rewrite this sentence to sound more formal: \"{q}\"", "Make this shorter: \"{q}\"",
              "Rewrite in simple words: \"{q}\"", "Rewrite this to sound friendlier: \"{q}\"",
              "Fix the grammar and punctuation, if needed: \"{q}\"", "Turn this into a question: \"{q}\"",
              "Translate this into French: \"{q}\"", "Summarise in a few words: \"{q}\""]
    prompts += [rng.choice(tpl_rw).format(q=q) for q in rng.sample(sorted(set(quotes)), min(500, len(quotes)))]
    blunt = ["Send me the report by tomorrow.", "Your code doesn't work.", "Stop being late to meetings.",
             "I need an answer right now.", "This food is cold.", "Move your car, it's blocking mine.",
             "You forgot to call me back.", "Turn the music down.", "We are not hiring you.", "Pay the invoice today."]
    prompts += [f"Rewrite this to sound more polite: \"{b}\"" for b in blunt]
    wordy = ["In the event that you have any questions, please do not hesitate to contact me at your earliest convenience.",
             "At this point in time we are not in a position to make a decision regarding the matter.",
             "It is of the utmost importance that all members of staff arrive on time for the meeting.",
             "The reason why I am writing to you is to inform you about the changes to the schedule.",
             "Despite the fact that the weather was bad, the match went ahead as planned.",
             "We would like to take this opportunity to thank each and every one of you for your hard work."]
    prompts += [f"Make this sentence shorter: \"{w}\"" for w in wordy]

    # Chat.
    chat = ["Hi! How are you today?", "Can you tell me a joke?", "I feel bored. Any ideas?", "What should I cook tonight?",
            "Recommend a book for a long weekend.", "I can't sleep. What can I do?", "How do I tell my boss I'm overworked?",
            "I'm nervous about a presentation tomorrow.", "What is a fun hobby to start this year?",
            "How can I be a better listener?", "My friend is sad. How can I cheer them up?", "What is a good gift for my mum?",
            "Is it better to rent or to buy a home?", "How do I start running if I'm out of shape?",
            "Any tips for a first date?", "How much water should I drink a day?", "What's a good way to start the morning?",
            "How do I stop procrastinating?", "Can you help me plan my weekend?", "What are some fun things to do in a city?",
            "I just moved to a new town. How do I meet people?", "How do I say no without feeling guilty?",
            "What's the difference between weather and climate?", "Tell me something interesting about octopuses.",
            "What should I know before adopting a cat?", "How do I make my mornings less rushed?",
            "Suggest a name for a bakery.", "Suggest a name for a podcast about science.", "What can I do with leftover rice?",
            "How do I keep my plants alive while I'm on holiday?", "How do I start journaling?",
            "Is coffee bad for you?", "What makes a good friend?", "Tell me a fun fact about space.",
            "What's a good habit to build this month?", "How do I deal with a noisy neighbour?"]
    prompts += chat

    # Keep the bundled eval and tune prompts unseen: drop anything that shares their topics.
    prompts = keep(prompts, BANNED, ctx.held_out())
    rng.shuffle(prompts)
    return text_file("# Generated by training/make-prompts4 (everyday requests written for selfspec).", prompts)
