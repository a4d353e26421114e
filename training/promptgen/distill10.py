"""distill10: two-turn conversations on everyday subjects, in the kinds of request chat benchmarks
group their questions by (writing, role-play, reasoning, arithmetic, coding, extraction, science,
humanities, summaries, rewriting, translation), with none of their questions: every prompt is a
template written here filled from subject lists written here, and the passages that extraction,
summary and rewriting requests quote are assembled here from made-up names, places and numbers.

Why: distill 1-9 lean on programming text (Python and Rust docs, the Jargon File), and the draft
layer's first guess on the bundled eval prompts is right 41% of the time against 53% on prompts
of its own training sets (`eval --tree chain:4`, 24 prompts each, Zen 4, 6 December 2026); 8% of
the tokens SmolLM2 writes for the eval prompts lie outside the 8,191-token draft vocabulary built
from those sets. This set widens the subjects and the words.

Deterministic (seed 10); reads nothing from the machine but the eval and tune prompts (dropped
topics, as every set since distill6 does: BANNED_WIDER) and the prompts of distill 1-9 (never
asked again)."""
import random

from .common import BANNED_WIDER, jsonl_file, keep

# Subjects by domain: nouns a general assistant is asked about, none of them an eval topic.
SUBJECTS = {
    "home": ["a kitchen garden", "a sourdough starter", "a slow cooker", "a compost heap", "a rainwater barrel", "a sewing machine",
             "a smoke alarm", "a dishwasher", "a wood stove", "a bread machine", "a cast-iron pan", "a rice cooker",
             "a house move", "a spare room", "a window box", "a tool shed", "a garage sale", "a leaking tap"],
    "food": ["pancakes", "lentil curry", "fresh pasta", "banana bread", "a fruit salad", "homemade pizza", "tomato sauce",
             "roast chicken", "porridge", "a cheese board", "spring rolls", "apple crumble", "hummus", "miso soup",
             "lemonade", "scrambled eggs", "a chocolate cake", "pickled onions", "a stir-fry", "potato salad"],
    "nature": ["a coral reef", "a rainforest", "a volcano", "a waterfall", "a river delta", "a mangrove swamp", "the Arctic tundra",
               "a meadow", "a kelp forest", "a salt marsh", "an oak tree", "a cactus", "moss", "mushrooms", "a thunderstorm",
               "a rainbow", "fog", "an earthquake", "a tsunami", "the northern lights"],
    "animals": ["hedgehogs", "otters", "foxes", "jellyfish", "hummingbirds", "beavers", "seahorses", "giraffes", "squirrels",
                "snails", "salmon", "eagles", "moles", "lizards", "badgers", "zebras", "flamingos", "spiders", "seals", "pandas"],
    "science": ["photosynthesis", "the immune system", "sound waves", "the periodic table", "plate tectonics", "the human heart",
                "rust on iron", "a solar panel", "a battery", "a microscope", "a rocket launch", "the Moon's phases", "a magnet",
                "the speed of light", "a chemical reaction", "evaporation", "the human eye", "a lever", "a telescope",
                "the ozone layer", "a light bulb", "nuclear power", "wind turbines", "the greenhouse effect", "bones", "sleep"],
    "health": ["stretching", "a balanced diet", "drinking enough water", "a good night's sleep", "walking every day", "yoga",
               "sun cream", "a first-aid kit", "hand washing", "posture at a desk", "stress", "a dentist visit", "swimming",
               "meditation", "hay fever", "a sprained ankle"],
    "history": ["the printing press", "the Roman roads", "the first Olympic Games", "the invention of the wheel", "ancient Egypt's pyramids",
                "the Silk Road", "the Industrial Revolution", "the first telephone", "the Moon landing", "medieval castles",
                "the Vikings", "the Renaissance", "the invention of paper", "the steam engine", "the first railways",
                "the Great Wall of China", "the ancient Greek theatre", "the history of money", "the first maps", "the postal service"],
    "culture": ["jazz", "opera", "folk tales", "origami", "street art", "board games", "poetry slams", "puppet theatre",
                "calligraphy", "a film festival", "a pottery class", "a choir", "a public library", "a museum of science",
                "a harvest festival", "a carnival", "comic books", "a photography exhibition"],
    "places": ["Brazil", "Greece", "Sweden", "Turkey", "Argentina", "Ireland", "South Korea", "Nepal", "Tanzania", "Croatia",
               "Australia", "Finland", "Jordan", "Colombia", "Austria", "the Netherlands", "Madagascar", "Mongolia"],
    "work": ["a team meeting", "a job offer", "a first day at work", "a project deadline", "working in a shop", "a small bakery business",
             "a market stall", "a farm", "a hospital night shift", "a train driver's day", "a call centre", "a newspaper office",
             "a hotel reception", "a building site", "a delivery route", "a school kitchen"],
    "tech": ["a smartphone battery", "a Wi-Fi router", "an e-reader", "a smartwatch", "a 3D printer", "a drone", "an electric car",
             "a video call", "a QR code", "a GPS map", "a digital camera", "a printer jam", "a spam filter", "a search engine",
             "a backup drive", "a game console"],
    "hobbies": ["knitting", "chess", "birdwatching", "rock climbing", "baking", "fishing", "stamp collecting", "astronomy",
                "woodworking", "kayaking", "juggling", "drawing", "cycling holidays", "hiking", "playing the piano", "bird feeders",
                "jigsaw puzzles", "sketching outdoors"],
}

WRITING = ["Write a short blog post about {s}.", "Write a friendly email to a friend about {s}.", "Write a haiku about {s}.",
           "Write a short story of about 100 words involving {s}.", "Write a persuasive paragraph about {s}.",
           "Write a limerick about {s}.", "Write an encyclopedia-style paragraph about {s}.", "Write a short speech about {s}.",
           "Write a diary entry from a day spent with {s}.", "Write a social media post about {s}.",
           "Write a short poem that rhymes about {s}.", "Write the opening paragraph of a novel that features {s}."]
ROLEPLAY = ["Pretend you are a tour guide. Tell visitors about {s}.", "You are a science teacher. Introduce {s} to your class.",
            "Act as a friendly shopkeeper and tell a customer about {s}.", "Imagine you are a radio host. Give a short segment about {s}.",
            "You are a grandparent telling a child about {s}. What do you say?", "Play a museum guide and describe {s}.",
            "You are a travel agent. Convince me to learn more about {s}.", "Pretend you are a news reporter covering {s}."]
REASONING = ["What are the pros and cons of {s}?", "Why do some people love {s} and others do not?",
             "What would change if {s} disappeared tomorrow?", "What is the most surprising thing about {s}?",
             "What questions should I ask before trying {s}?", "What are three common myths about {s}?",
             "How would you explain {s} to someone who has never heard of it?", "What can {s} teach us about everyday life?"]
EXPLAIN = ["Explain {s} in simple terms.", "How does {s} work?", "Tell me five facts about {s}.", "Why is {s} important?",
           "What is the history of {s}?", "Describe {s} in three sentences.", "What should a beginner know about {s}?",
           "Give me a short overview of {s}."]
LISTS = ["List five things people often get wrong about {s}.", "Give me a checklist for {s}.",
         "List seven words that describe {s}.", "Give me ten questions a child might ask about {s}.",
         "List the steps to get started with {s}.", "Give me three ideas for a school project about {s}."]
FOLLOW = ["Can you make it shorter?", "Now explain it to a five-year-old.", "Can you add one more point?",
          "Can you turn that into a numbered list?", "Rewrite it in a more formal tone.", "What is the most important part of that?",
          "Can you give an example?", "Thanks! Can you summarise it in one sentence?", "Make it funnier.",
          "What would you add for an expert?", "Can you write a title for it?", "Which part is most often misunderstood?",
          "Can you say that without any jargon?", "Why does that matter?", "Give me a quiz question about it."]

NAMES = ["Amara", "Ben", "Chen", "Dalia", "Emil", "Farah", "Gus", "Hana", "Ivo", "Jude", "Kofi", "Lena", "Mateo", "Nia",
         "Omar", "Pia", "Quinn", "Rosa", "Sami", "Tess", "Uma", "Vik", "Wren", "Yara", "Zane"]
TOWNS = ["Ashford", "Brookvale", "Cedar Falls", "Dunmore", "Elmstead", "Fairport", "Glenwood", "Harlow Bay", "Ivybridge",
         "Juniper Hill", "Kingsmere", "Larkton", "Millbrook", "Northgate", "Oakridge", "Pebble Cove"]
THINGS = ["notebooks", "pencils", "apples", "tickets", "cupcakes", "stickers", "plants", "candles", "mugs", "posters", "books",
          "scarves", "lamps", "chairs", "bottles of juice", "bags of flour"]
EVENTS = ["a charity run", "a book fair", "a science fair", "a street market", "a garden show", "a music evening",
          "a craft workshop", "a chess tournament", "a film night", "a cooking contest", "a spring fete", "a quiz night"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"]


def passage(rng):
    """A made-up news item: names, a town, an event, a date, counts and money."""
    a, b = rng.sample(NAMES, 2)
    town, event, month = rng.choice(TOWNS), rng.choice(EVENTS), rng.choice(MONTHS)
    day, people, money, thing, n = rng.randint(1, 28), rng.randint(40, 900), rng.randint(150, 9000), rng.choice(THINGS), rng.randint(20, 400)
    return (f"On {month} {day}, {town} held {event} organised by {a} and {b}. About {people} people came, and the "
            f"organisers raised ${money} for the local school. Volunteers handed out {n} {thing}, and {b} said the "
            f"day went better than planned. The next one is expected in {rng.choice(MONTHS)}.")


def arithmetic(rng):
    """A small word problem with numbers drawn here."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b, c = rng.randint(3, 40), rng.randint(2, 12), rng.randint(2, 9)
    price = rng.randint(2, 25)
    kinds = [f"{name} buys {a} {thing} at ${price} each and pays with ${a * price + rng.randint(1, 50)}. How much change does {name} get?",
             f"A box holds {b} {thing}. How many boxes are needed for {a * b + rng.randint(1, b - 1)} {thing}?",
             f"{name} reads {b} pages a day. How many days will a book of {a * b} pages take?",
             f"A train leaves at 9:{rng.randint(10, 59)} and the trip takes {c} hours and {rng.randint(5, 55)} minutes. When does it arrive?",
             f"{name} has {a} {thing} and gives away a third of them, rounded down. How many are left?",
             f"A recipe needs {c} eggs for {b} people. How many eggs are needed for {b * c} people?",
             f"What is {a}% of {price * 20}? Show the working.",
             f"The perimeter of a rectangle is {2 * (a + b)} cm and one side is {a} cm. How long is the other side?"]
    return rng.choice(kinds)


def generate(ctx):
    rng = random.Random(10)
    firsts = []
    subjects = [(d, s) for d, xs in SUBJECTS.items() for s in xs]
    # Each subject under a few request kinds, drawn so every kind meets every domain.
    for d, s in subjects:
        for pool in rng.sample([WRITING, ROLEPLAY, REASONING, EXPLAIN, LISTS], 4):
            firsts.append(rng.choice(pool).format(s=s))
    # Comparisons inside a domain.
    for d, xs in SUBJECTS.items():
        for _ in range(6):
            a, b = rng.sample(xs, 2)
            firsts.append(rng.choice(["Compare {a} and {b}.", "What do {a} and {b} have in common?",
                                      "Which is more interesting, {a} or {b}? Explain your choice."]).format(a=a, b=b))
    # Arithmetic word problems, coding requests on made-up data, extraction, summaries, rewriting, translation.
    firsts += [arithmetic(rng) for _ in range(240)]
    code = ["Write a Python function that counts how many {t} each person in a list of (name, count) pairs has.",
            "Write a JavaScript function that sorts a list of {t} by price.",
            "Write a Python class for an inventory of {t} with add and remove methods.",
            "Write an SQL table for a shop that sells {t}, and a query that finds the five cheapest.",
            "Write a Python script that reads a CSV of {t} sales and prints the total per month."]
    firsts += [rng.choice(code).format(t=rng.choice(THINGS)) for _ in range(120)]
    quoted = ["Extract the names, the date and the amounts from this text:\n\n{p}", "Summarise this in one sentence:\n\n{p}",
              "Rewrite this news item for a children's newsletter:\n\n{p}", "Turn this into three bullet points:\n\n{p}",
              "Write a headline for this story:\n\n{p}", "What questions would a reporter ask after reading this?\n\n{p}",
              "Rewrite this in the first person, as one of the organisers:\n\n{p}", "Translate the first sentence of this into French:\n\n{p}"]
    firsts += [rng.choice(quoted).format(p=passage(rng)) for _ in range(360)]
    firsts = keep(firsts, BANNED_WIDER, ctx.held_out(),
                  ctx.seen(["distill", "distill2", "distill3", "distill4", "distill5", "distill6", "distill7", "distill8", "distill9"]))
    rng.shuffle(firsts)
    return jsonl_file({"turns": [p, rng.choice(FOLLOW)]} for p in firsts)
