"""Writes `nanoserve/model/demo/corpus.txt`: synthetic English for the demo tokenizer and model.

The corpus is a sequence of documents, each terminated by `<|endoftext|>` and a newline. A document
is either a ChatML dialogue (`<|im_start|>role\\n...<|im_end|>\\n` per message) or plain prose.
Everything is generated from small hand-written tables by a seeded `random.Random`, so the same seed
and target size always give byte-identical output (stdlib only, no network).

Usage: python scripts/make_demo_corpus.py [--seed N] [--target-bytes N] [--out PATH]
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "nanoserve" / "model" / "demo" / "corpus.txt"
END_OF_TEXT = "<|endoftext|>"

DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December")
SEASONS = ("spring", "summer", "autumn", "winter")
COLOURS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white", "grey")
PLANETS = ("Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune")
ONES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
        "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen")
TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")

CAPITALS = (
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Portugal", "Lisbon"), ("Japan", "Tokyo"), ("China", "Beijing"), ("India", "New Delhi"),
    ("Canada", "Ottawa"), ("Australia", "Canberra"), ("Brazil", "Brasília"), ("Argentina", "Buenos Aires"),
    ("Mexico", "Mexico City"), ("Egypt", "Cairo"), ("Kenya", "Nairobi"), ("Norway", "Oslo"),
    ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Denmark", "Copenhagen"), ("Poland", "Warsaw"),
    ("Greece", "Athens"), ("Ireland", "Dublin"), ("Austria", "Vienna"), ("Hungary", "Budapest"),
    ("Peru", "Lima"), ("Chile", "Santiago"), ("South Korea", "Seoul"), ("Thailand", "Bangkok"),
    ("Vietnam", "Hanoi"), ("Turkey", "Ankara"), ("Iceland", "Reykjavík"), ("Belgium", "Brussels"),
    ("Czechia", "Prague"), ("Morocco", "Rabat"), ("Nigeria", "Abuja"), ("Ghana", "Accra"),
    ("New Zealand", "Wellington"), ("Colombia", "Bogotá"), ("Cuba", "Havana"), ("Ethiopia", "Addis Ababa"),
    ("Romania", "Bucharest"), ("Ukraine", "Kyiv"), ("Malaysia", "Kuala Lumpur"), ("Philippines", "Manila"),
)

# name, sound verb (or None), number of legs, where it lives, young, food
ANIMALS = (
    ("dog", "barks", 4, "in a kennel", "puppy", "meat and biscuits"),
    ("cat", "meows", 4, "in a house", "kitten", "fish and meat"),
    ("cow", "moos", 4, "in a barn", "calf", "grass"),
    ("horse", "neighs", 4, "in a stable", "foal", "hay and oats"),
    ("sheep", "bleats", 4, "in a field", "lamb", "grass"),
    ("pig", "oinks", 4, "in a sty", "piglet", "almost anything"),
    ("duck", "quacks", 2, "in a pond", "duckling", "seeds and small bugs"),
    ("chicken", "clucks", 2, "in a coop", "chick", "seeds and grain"),
    ("owl", "hoots", 2, "in a tree", "owlet", "mice"),
    ("lion", "roars", 4, "in a den", "cub", "meat"),
    ("frog", "croaks", 4, "in a pond", "tadpole", "insects"),
    ("bee", "buzzes", 6, "in a hive", "larva", "nectar and pollen"),
    ("spider", None, 8, "on a web", "spiderling", "insects"),
    ("snake", "hisses", 0, "in a burrow", "hatchling", "mice and eggs"),
    ("wolf", "howls", 4, "in a den", "pup", "meat"),
    ("goat", "bleats", 4, "on a farm", "kid", "grass and leaves"),
    ("bear", "growls", 4, "in a den", "cub", "berries and fish"),
    ("mouse", "squeaks", 4, "in a hole", "pup", "seeds and cheese"),
    ("elephant", "trumpets", 4, "in a herd", "calf", "grass, leaves and fruit"),
    ("donkey", "brays", 4, "in a stable", "foal", "hay"),
    ("ant", None, 6, "in a colony", "larva", "sugar and seeds"),
    ("penguin", "squawks", 2, "in a colony", "chick", "fish"),
)

THING_COLOURS = (
    ("the sky on a clear day", "blue"), ("grass", "green"), ("fresh snow", "white"), ("coal", "black"),
    ("a ripe banana", "yellow"), ("a lemon", "yellow"), ("a strawberry", "red"), ("a ripe tomato", "red"),
    ("a carrot", "orange"), ("a pumpkin", "orange"), ("a plum", "purple"), ("chocolate", "brown"),
    ("milk", "white"), ("a sunflower", "yellow"), ("a cucumber", "green"), ("a lime", "green"),
    ("a cherry", "red"), ("a violet", "purple"), ("wet soil", "brown"), ("a ruby", "red"),
    ("a sapphire", "blue"), ("an emerald", "green"), ("a flamingo", "pink"), ("an elephant", "grey"),
)

OPPOSITES = (
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("happy", "sad"), ("day", "night"),
    ("light", "dark"), ("open", "closed"), ("full", "empty"), ("young", "old"), ("new", "old"),
    ("early", "late"), ("wet", "dry"), ("hard", "soft"), ("loud", "quiet"), ("tall", "short"),
    ("inside", "outside"), ("left", "right"), ("push", "pull"), ("begin", "end"), ("win", "lose"),
    ("true", "false"), ("high", "low"), ("near", "far"), ("clean", "dirty"), ("strong", "weak"),
    ("easy", "difficult"), ("thick", "thin"), ("sweet", "sour"), ("buy", "sell"), ("give", "take"),
    ("arrive", "leave"), ("remember", "forget"), ("always", "never"), ("first", "last"),
    ("question", "answer"), ("above", "below"), ("wide", "narrow"), ("cheap", "expensive"),
)

NAMES = ("Alice", "Ben", "Chloe", "Daniel", "Emma", "Felix", "Grace", "Hugo", "Iris", "Jack", "Kira", "Leo",
         "Maya", "Noah", "Olivia", "Pablo", "Quinn", "Rosa", "Sam", "Tara", "Uma", "Victor", "Wendy",
         "Xavier", "Yara", "Zoe", "Omar", "Priya", "Kenji", "Amara", "Lucas", "Nina", "Theo", "Ivy",
         "Hannah", "Oscar",
         "Matilda", "Ravi", "Sofia", "Elijah", "Freya", "Mateo", "Ingrid", "Tobias", "Lena", "Ahmed", "Clara",
         "Dmitri", "Esther", "Finn", "Gemma", "Hector", "Isla", "Jonah", "Keiko", "Lars", "Mira", "Nadia",
         "Otto", "Petra", "Rufus", "Selma", "Tomas", "Ulrich", "Vera", "Wilbur", "Zara", "Bruno", "Delia")
PLACES = ("the park", "the market", "the library", "the beach", "the forest", "the village", "the city",
          "the harbour", "the school", "the bakery", "the garden", "the museum", "the station",
          "the mountains", "the river", "the farm", "the zoo", "the castle", "the island", "the valley",
          "the lighthouse", "the meadow", "the orchard", "the cathedral", "the swimming pool", "the bridge",
          "the cinema", "the post office", "the playground", "the waterfall", "the desert", "the lake",
          "the workshop", "the greenhouse", "the theatre", "the hospital", "the airport", "the pier")
# singular, plural
ITEMS = (
    ("apple", "apples"), ("pear", "pears"), ("orange", "oranges"), ("book", "books"), ("pencil", "pencils"),
    ("marble", "marbles"), ("cookie", "cookies"), ("egg", "eggs"), ("flower", "flowers"), ("stamp", "stamps"),
    ("shell", "shells"), ("coin", "coins"), ("balloon", "balloons"), ("sticker", "stickers"),
    ("cupcake", "cupcakes"), ("candle", "candles"), ("button", "buttons"), ("ticket", "tickets"),
    ("basket", "baskets"), ("leaf", "leaves"), ("box", "boxes"), ("peach", "peaches"), ("cherry", "cherries"),
)
ADJECTIVES = ("bright", "quiet", "curious", "gentle", "brave", "clever", "sleepy", "cheerful", "tiny",
              "enormous", "ancient", "shiny", "friendly", "patient", "careful", "noisy", "golden", "silver",
              "windy", "foggy", "warm", "chilly", "peaceful", "busy", "lonely", "playful", "wise", "proud",
              "humble", "colourful", "mysterious", "polite", "generous", "nervous", "eager", "calm",
              "adventurous", "cautious", "forgetful", "graceful", "grumpy", "honest", "jolly", "kind",
              "lively", "mischievous", "modest", "restless", "shy", "stubborn", "thoughtful", "wobbly",
              "speckled", "striped", "fluffy", "rusty", "velvety", "elegant", "clumsy", "dazzling")
CREATURES = ("fox", "rabbit", "hedgehog", "squirrel", "badger", "otter", "robin", "turtle", "crow", "deer",
             "beaver", "lizard", "owl", "mouse", "goose", "swan", "kitten", "puppy", "dragon", "giant",
             "raccoon", "pelican", "tortoise", "parrot", "walrus", "moose", "heron", "camel", "koala",
             "chameleon", "panda", "sparrow", "salamander", "unicorn", "mole", "weasel", "gecko")
# past tense verb phrases used in stories
DEEDS = ("found a lost key", "built a small boat", "painted the fence", "planted some seeds",
         "baked a loaf of bread", "wrote a long letter", "climbed the tallest hill", "fixed an old clock",
         "learned a new song", "crossed the river", "lit a lantern", "drew a map of the valley",
         "caught a falling star", "shared lunch with a stranger", "counted the stars", "read a dusty book",
         "knitted a warm scarf", "rescued a kite from a tree", "cleaned the whole kitchen",
         "followed a trail of footprints", "opened a secret door", "carried water from the well",
         "repaired a broken umbrella", "sorted a jar of buttons", "swept the dusty attic",
         "sang to the neighbours", "delivered a parcel across town", "mended a torn sail",
         "discovered a hidden cave", "organised a picnic by the lake", "invented a clever machine",
         "polished the brass doorknob", "photographed a rainbow", "solved a difficult puzzle",
         "decorated the hallway with lanterns", "rowed a boat to the lighthouse", "tidied the cupboard",
         "harvested pumpkins from the field", "fed the ducks at the pond", "explored an abandoned mill")
FEELINGS = ("happy", "proud", "tired", "surprised", "grateful", "excited", "hungry", "relieved", "calm",
            "confident", "delighted", "puzzled", "hopeful", "content", "amazed", "thankful")
WEATHER = ("sunny", "rainy", "cloudy", "windy", "snowy", "foggy", "stormy", "warm", "cold")
# job, what the job does
JOBS = (
    ("baker", "bakes bread, cakes and pastries"), ("carpenter", "builds furniture and houses from wood"),
    ("doctor", "helps sick people get better"), ("nurse", "cares for patients in a hospital"),
    ("teacher", "helps students learn"), ("farmer", "grows crops and raises animals"),
    ("pilot", "flies aeroplanes"), ("chef", "cooks meals in a restaurant"),
    ("firefighter", "puts out fires and rescues people"), ("librarian", "looks after books in a library"),
    ("plumber", "repairs pipes, taps and drains"), ("electrician", "installs and repairs wiring"),
    ("gardener", "looks after plants, lawns and flower beds"), ("dentist", "takes care of teeth"),
    ("architect", "designs buildings"), ("mechanic", "repairs cars and engines"),
    ("tailor", "makes and mends clothes"), ("fisherman", "catches fish"),
    ("photographer", "takes photographs"), ("journalist", "writes news stories"),
    ("astronaut", "travels into space"), ("veterinarian", "treats sick animals"),
    ("musician", "plays and composes music"), ("painter", "paints pictures or walls"),
    ("postman", "delivers letters and parcels"), ("scientist", "studies the world with experiments"),
    ("judge", "decides cases in a court"), ("engineer", "designs machines, bridges and roads"),
    ("cashier", "takes payments in a shop"), ("translator", "turns text from one language into another"),
)
# tool, what it is used for
TOOLS = (
    ("hammer", "drive nails into wood"), ("saw", "cut wood"), ("screwdriver", "turn screws"),
    ("ladder", "reach high places"), ("broom", "sweep the floor"), ("spade", "dig holes in the ground"),
    ("needle", "sew cloth"), ("scissors", "cut paper or cloth"), ("ruler", "measure and draw straight lines"),
    ("thermometer", "measure temperature"), ("compass", "find north"), ("telescope", "look at distant stars"),
    ("microscope", "see very small things"), ("kettle", "boil water"), ("umbrella", "keep dry in the rain"),
    ("wrench", "tighten bolts"), ("paintbrush", "spread paint"), ("calculator", "do arithmetic quickly"),
    ("clock", "tell the time"), ("map", "find the way"), ("key", "open a lock"), ("torch", "see in the dark"),
)
# thing, what it is usually made of
MATERIALS = (
    ("window", "glass"), ("table", "wood"), ("coin", "metal"), ("sweater", "wool"), ("bottle", "glass"),
    ("brick", "baked clay"), ("notebook", "paper"), ("candle", "wax"), ("shoe", "leather or fabric"),
    ("tyre", "rubber"), ("nail", "steel"), ("cup", "china or clay"), ("rope", "fibre"),
    ("pencil", "wood and graphite"),
)
# vehicle, how it travels
VEHICLES = (
    ("ship", "sails across the sea"), ("train", "runs on rails"), ("aeroplane", "flies through the air"),
    ("bicycle", "is pedalled along roads and paths"), ("submarine", "travels under the water"),
    ("helicopter", "hovers and flies with spinning blades"), ("tractor", "pulls heavy loads on a farm"),
    ("canoe", "is paddled along rivers"), ("bus", "carries many passengers along the streets"),
    ("rocket", "launches into space"), ("sledge", "slides over snow"), ("tram", "runs on rails in a city"),
)
# shape, number of sides
SHAPES = (("triangle", 3), ("square", 4), ("rectangle", 4), ("pentagon", 5), ("hexagon", 6), ("octagon", 8))
# body part (plural), what we do with it
BODY = (
    ("eyes", "see"), ("ears", "hear"), ("nose", "smell"), ("tongue", "taste"), ("hands", "hold things"),
    ("legs", "walk and run"), ("lungs", "breathe"), ("teeth", "chew food"), ("fingers", "touch and grip"),
)
SYNONYMS = (
    ("big", "large"), ("small", "little"), ("happy", "glad"), ("quick", "rapid"), ("begin", "start"),
    ("finish", "complete"), ("angry", "cross"), ("shut", "close"), ("smart", "intelligent"),
    ("tired", "sleepy"), ("scared", "afraid"), ("pretty", "beautiful"), ("choose", "pick"),
    ("correct", "right"), ("gift", "present"), ("quiet", "silent"), ("rich", "wealthy"), ("jump", "leap"),
    ("talk", "speak"), ("look", "gaze"), ("strange", "unusual"), ("hurry", "rush"), ("ill", "sick"),
)
HOBBIES = ("gardening", "painting", "swimming", "chess", "cycling", "reading novels", "playing the violin",
           "playing the piano", "playing the guitar", "birdwatching", "photography", "knitting", "hiking",
           "pottery", "juggling", "sailing", "baking", "dancing", "stargazing", "woodworking", "fishing")
FOODS = ("soup", "pasta", "rice", "noodles", "salad", "porridge", "pancakes", "omelette", "sandwiches",
         "dumplings", "curry", "stew", "pie", "toast with honey", "grilled vegetables", "lentils", "yoghurt",
         "strawberries", "blueberries", "watermelon", "pineapple", "mushrooms", "broccoli", "spinach")
ADVERBS = ("slowly", "quickly", "quietly", "carefully", "happily", "suddenly", "gently", "bravely",
           "patiently", "eagerly", "proudly", "softly", "cheerfully", "politely", "silently", "swiftly")
# task, steps
HOWTOS = (
    ("make a cup of tea", ("Boil some water in a kettle", "Put a tea bag in a cup",
                           "Pour the hot water over it", "Wait three or four minutes",
                           "Take out the tea bag and add milk if you like")),
    ("plant a seed", ("Fill a small pot with soil", "Push the seed gently into the soil", "Water it a little",
                      "Put the pot somewhere bright", "Keep the soil damp while it grows")),
    ("wash your hands", ("Wet your hands with clean water", "Rub soap over your palms and fingers",
                         "Scrub for about twenty seconds", "Rinse off the soap",
                         "Dry your hands with a towel")),
    ("make a sandwich", ("Take two slices of bread", "Spread butter on one side of each slice",
                         "Add a filling such as cheese or tomato", "Put the slices together",
                         "Cut it in half")),
    ("cross the road safely", ("Stop at the kerb", "Look left and right", "Listen for traffic",
                               "Walk straight across when the road is clear")),
    ("write a letter", ("Write the date at the top", "Begin with a greeting", "Say what you want to say",
                        "End with a kind closing", "Sign your name")),
    ("pack for a trip", ("Make a list of what you need", "Check the weather forecast", "Fold your clothes",
                         "Pack your toothbrush and toothpaste", "Remember your tickets")),
)
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a friendly assistant. Answer briefly and clearly.",
    "You are a patient teacher who explains things simply.",
    "You are a concise assistant. Give short, correct answers.",
    "You are a helpful assistant that answers questions about numbers, words and facts.",
)
# language, English word, translation
TRANSLATIONS = (
    ("French", "hello", "bonjour"), ("French", "thank you", "merci"), ("French", "coffee", "café"),
    ("French", "brother", "frère"), ("Spanish", "hello", "hola"), ("Spanish", "thank you", "gracias"),
    ("Spanish", "year", "año"), ("Spanish", "child", "niño"), ("German", "thank you", "danke"),
    ("German", "green", "grün"), ("German", "beautiful", "schön"), ("Portuguese", "bread", "pão"),
    ("Japanese", "hello", "こんにちは"), ("Japanese", "thank you", "ありがとう"), ("Japanese", "cat", "猫"),
    ("Japanese", "water", "水"), ("Japanese", "mountain", "山"), ("Chinese", "hello", "你好"),
    ("Chinese", "thank you", "谢谢"), ("Chinese", "person", "人"), ("Chinese", "big", "大"),
    ("Korean", "hello", "안녕하세요"), ("Korean", "thank you", "감사합니다"), ("Greek", "water", "νερό"),
    ("Russian", "hello", "привет"), ("Russian", "thank you", "спасибо"), ("Polish", "thank you", "dziękuję"),
    ("Turkish", "thank you", "teşekkürler"), ("Vietnamese", "hello", "xin chào"), ("Hindi", "hello", "नमस्ते"),
    ("Swedish", "thank you", "tack"),
)
# questions about the assistant itself, and its answers
IDENTITY = (
    ("Who are you?", "I am the nanoserve demo model, a very small language model. I can answer simple questions "
                     "about numbers, words and facts."),
    ("What is your name?", "I am the demo model that comes with nanoserve. I do not have a name of my own."),
    ("What can you do?", "I can do simple arithmetic, answer questions about animals, countries, colours and words, "
                         "and tell short stories."),
    ("Are you a human?", "No, I am a small language model. I run on your computer inside nanoserve."),
    ("Are you a robot?", "Not quite. I am a small language model that runs inside nanoserve."),
    ("How old are you?", "I do not have an age. I am a small language model that was trained in a few minutes."),
    ("Where do you live?", "I live inside nanoserve, on the computer that is running me."),
    ("Do you have feelings?", "No, I do not. I am a small language model that predicts the next word."),
)
# questions the corpus has no facts for; the assistant says so politely
OFF_TOPIC = ("What is the meaning of life?", "Who will win the next election?", "What will the weather be tomorrow?",
             "What is the price of gold today?", "Can you write me a poem?", "What is quantum physics?",
             "Who is the best football player?", "How do I fix my car?", "What is the latest news?",
             "Can you help me with my homework?", "What should I cook tonight?", "Why is the sea salty?",
             "How does the internet work?", "What is the square root of two?", "Who invented the telephone?",
             "Can you recommend a good film?", "What time is it?", "How far away is the Moon?")
OFF_TOPIC_ANSWERS = (
    "I am sorry, I do not know the answer to that. I am a small model and I only know simple facts.",
    "That is a good question, but I do not know the answer. I can help with arithmetic, words and simple facts.",
    "I am not sure. I am only a small demo model, so I know about numbers, words, animals and places.",
)
MULTIBYTE_LINES = (
    "We shared a crème brûlée at a little café near the station.",
    "Her résumé mentioned a year in Zürich and a summer in São Paulo.",
    "The naïve fiancé ordered a jalapeño piñata for the party.",
    "The façade of the old hotel in Kraków was painted pale yellow.",
    "Happy birthday! 🎉🎂 I hope your day is wonderful.",
    "The cat 🐱 sat on the mat while the dog 🐶 slept by the door.",
    "Great job on the test 👍🏽 — you worked hard for it.",
    "Good morning ☀️ Let's go for a walk before it rains 🌧️.",
    "I love pizza 🍕 and ice cream 🍦 on Fridays.",
    "Our family 👨‍👩‍👧 travelled to France 🇫🇷 last summer.",
    "See you soon 👋 and safe travels ✈️!",
    "The temperature dropped to −5 °C, so we drank hot cocoa ☕.",
    "In Tokyo (東京) we saw cherry blossoms 🌸 in April.",
    "The word 日本語 means the Japanese language.",
    "Price: 12 € or about £10 — a fair deal.",
    "Ελληνικά and русский use their own alphabets.",
)


def number_words(n: int) -> str:
    """English words for 0 <= n < 1000, e.g. 47 -> 'forty-seven'."""
    if n < 20:
        return ONES[n]
    if n < 100:
        tens, ones = divmod(n, 10)
        return TENS[tens] + ("-" + ONES[ones] if ones else "")
    hundreds, rest = divmod(n, 100)
    head = ONES[hundreds] + " hundred"
    return head + (" and " + number_words(rest) if rest else "")


def chat(rng: random.Random, turns: list[tuple[str, str]]) -> str:
    """A ChatML document with an optional system message and the given (user, assistant) turns."""
    parts = []
    if rng.random() < 0.5:
        parts.append(("system", rng.choice(SYSTEM_PROMPTS)))
    for user, assistant in turns:
        parts += [("user", user), ("assistant", assistant)]
    return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in parts)


def arithmetic_qa(rng: random.Random) -> tuple[str, str]:
    """One arithmetic question and its correct answer."""
    op = rng.choice("+-*/")
    if op == "+":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        result, sym = a + b, "+"
    elif op == "-":
        b, a = sorted((rng.randint(0, 99), rng.randint(0, 99)))
        result, sym = a - b, "-"
    elif op == "*":
        a, b = rng.randint(0, 12), rng.randint(0, 12)
        result, sym = a * b, "×" if rng.random() < 0.2 else "*"
    else:
        b, result = rng.randint(1, 12), rng.randint(0, 12)
        a, sym = b * result, "/"
    expr = f"{a} {sym} {b}"
    question = rng.choice(("What is {e}?", "Calculate {e}.", "How much is {e}?", "{e} = ?", "Compute {e}."))
    return question.format(e=expr), f"{expr} = {result}."


def comparison_qa(rng: random.Random) -> tuple[str, str]:
    """A question about ordering or parity of numbers."""
    a, b = rng.sample(range(1000), 2)
    kind = rng.randrange(3)
    if kind == 0:
        return f"Which is bigger, {a} or {b}?", f"{max(a, b)} is bigger than {min(a, b)}."
    if kind == 1:
        return f"Is {a} even or odd?", f"{a} is {'even' if a % 2 == 0 else 'odd'}."
    return f"Write {a} in words.", f"{a} is written as {number_words(a)}."


def list_qa(rng: random.Random) -> tuple[str, str]:
    """A question whose answer is (part of) an ordered list."""
    kind = rng.randrange(6)
    if kind == 0:
        return "List the days of the week.", "The days of the week are " + join_list(DAYS) + "."
    if kind == 1:
        i = rng.randrange(12)
        return f"Which month comes after {MONTHS[i]}?", f"{MONTHS[(i + 1) % 12]} comes after {MONTHS[i]}."
    if kind == 2:
        start = rng.randint(0, 60)
        end = start + rng.randint(3, 15)
        return f"Count from {start} to {end}.", ", ".join(str(n) for n in range(start, end + 1)) + "."
    if kind == 3:
        picked = rng.sample(COLOURS, rng.randint(3, 6))
        answer = "Here are some colours: " + join_list(picked) + "."
        return f"Name {number_words(len(picked))} colours.", answer
    if kind == 4:
        i = rng.randrange(7)
        return f"What day comes before {DAYS[i]}?", f"{DAYS[i - 1]} comes before {DAYS[i]}."
    i = rng.randrange(8)
    return (f"Which planet is number {i + 1} from the Sun?",
            f"{PLANETS[i]} is the {ordinal(i + 1)} planet from the Sun.")


def fact_qa(rng: random.Random) -> tuple[str, str]:
    """A question answered from one of the fact tables."""
    kind = rng.randrange(5)
    if kind == 0:
        country, city = rng.choice(CAPITALS)
        return f"What is the capital of {country}?", f"The capital of {country} is {city}."
    if kind == 1:
        name, sound, legs, home, young, food = rng.choice(ANIMALS)
        a_name = with_article(name)
        question = rng.choice(("legs", "young", "food", "home") + (("sound",) if sound else ()))
        return {
            "legs": (f"How many legs does {a_name} have?",
                     f"{capitalise(a_name)} has {number_words(legs)} legs."),
            "young": (f"What is a baby {name} called?", f"A baby {name} is called {with_article(young)}."),
            "food": (f"What does {a_name} eat?", f"{capitalise(a_name)} eats {food}."),
            "home": (f"Where does {a_name} live?", f"{capitalise(a_name)} often lives {home}."),
            "sound": (f"What sound does {a_name} make?", f"{capitalise(a_name)} {sound}."),
        }[question]
    if kind == 2:
        thing, colour = rng.choice(THING_COLOURS)
        return f"What colour is {thing}?", f"{capitalise(thing)} is {colour}."
    if kind == 3:
        a, b = rng.choice(OPPOSITES)
        a, b = (b, a) if rng.random() < 0.5 else (a, b)
        return f"What is the opposite of \"{a}\"?", f"The opposite of \"{a}\" is \"{b}\"."
    word = rng.choice(ITEMS)[0]
    return f"How do you spell {word}?", f"The word \"{word}\" is spelled {'-'.join(word)}."


def world_qa(rng: random.Random) -> tuple[str, str]:
    """A question about jobs, tools, materials, vehicles, shapes, the body or word meanings."""
    kind = rng.randrange(7)
    if kind == 0:
        job, does = rng.choice(JOBS)
        return f"What does {with_article(job)} do?", f"{capitalise(with_article(job))} {does}."
    if kind == 1:
        tool, use = rng.choice(TOOLS)
        return f"What is {with_article(tool)} for?", f"{capitalise(with_article(tool))} is used to {use}."
    if kind == 2:
        thing, material = rng.choice(MATERIALS)
        return (f"What is {with_article(thing)} made of?",
                f"{capitalise(with_article(thing))} is usually made of {material}.")
    if kind == 3:
        vehicle, how = rng.choice(VEHICLES)
        return f"How does {with_article(vehicle)} travel?", f"{capitalise(with_article(vehicle))} {how}."
    if kind == 4:
        shape, sides = rng.choice(SHAPES)
        return (f"How many sides does {with_article(shape)} have?",
                f"{capitalise(with_article(shape))} has {number_words(sides)} sides.")
    if kind == 5:
        part, use = rng.choice(BODY)
        return f"What do we use our {part} for?", f"We use our {part} to {use}."
    a, b = rng.choice(SYNONYMS)
    a, b = (b, a) if rng.random() < 0.5 else (a, b)
    return f"What is another word for \"{a}\"?", f"Another word for \"{a}\" is \"{b}\"."


def howto_qa(rng: random.Random) -> tuple[str, str]:
    """A how-to question answered with numbered steps."""
    task, steps = rng.choice(HOWTOS)
    body = "\n".join(f"{i}. {step}." for i, step in enumerate(steps, 1))
    return f"How do I {task}?", f"Here is how to {task}:\n{body}"


def greeting_qa(rng: random.Random) -> tuple[str, str]:
    """A greeting or small-talk exchange."""
    name, day = rng.choice(NAMES), rng.randrange(7)
    return rng.choice((
        (f"Hello! My name is {name}.", f"Hello, {name}! It is nice to meet you. How can I help you today?"),
        ("Hi!", "Hi there! What would you like to talk about?"),
        ("Good morning.", "Good morning! I hope you slept well."),
        ("How are you?", "I am doing well, thank you for asking. How are you?"),
        ("Thank you for your help.", "You are welcome! Let me know if you need anything else."),
        ("Goodbye!", "Goodbye! Have a wonderful day."),
        (f"What day is it after {DAYS[day]}?", f"The day after {DAYS[day]} is {DAYS[(day + 1) % 7]}."),
        ("Can you tell me a short fact?", "Sure! " + fact_qa(rng)[1]),
    ))


def translation_qa(rng: random.Random) -> tuple[str, str]:
    """A question about a word in another language (multibyte text)."""
    lang, english, word = rng.choice(TRANSLATIONS)
    return f"How do you say \"{english}\" in {lang}?", f"In {lang}, \"{english}\" is \"{word}\"."


def identity_qa(rng: random.Random) -> tuple[str, str]:
    """A question about the assistant itself."""
    return rng.choice(IDENTITY)


def off_topic_qa(rng: random.Random) -> tuple[str, str]:
    """A question outside the corpus's knowledge, answered with a polite admission."""
    return rng.choice(OFF_TOPIC), rng.choice(OFF_TOPIC_ANSWERS)


def story_qa(rng: random.Random) -> tuple[str, str]:
    """A request for a story, answered with one (about the requested creature, if any)."""
    if rng.random() < 0.5:
        return rng.choice(("Tell me a story.", "Tell me a short story.", "Can you tell me a story?")), story(rng)
    creature = rng.choice(CREATURES)
    request = rng.choice((f"Tell me a story about {with_article(creature)}.",
                          f"Write a short story about {with_article(creature)}."))
    return request, story(rng, creature)


def describe_qa(rng: random.Random) -> tuple[str, str]:
    """A request to describe an animal or a country, answered with a few sentences of facts."""
    if rng.random() < 0.5:
        country, city = rng.choice(CAPITALS)
        answer = f"{country} is a country. Its capital city is {city}."
        return rng.choice((f"Tell me about {country}.", f"What do you know about {country}?")), answer
    name, sound, legs, home, young, food = rng.choice(ANIMALS)
    sentences = [f"{capitalise(with_article(name))} is an animal with {number_words(legs) if legs else 'no'} legs.",
                 f"It often lives {home} and eats {food}.", f"A baby {name} is called {with_article(young)}."]
    if sound:
        sentences.insert(1, f"It {sound}.")
    question = rng.choice((f"Tell me about {with_article(name)}.", f"What do you know about the {name}?",
                           f"Describe {with_article(name)}."))
    return question, " ".join(sentences)


def word_problem(rng: random.Random) -> str:
    """A short arithmetic story in prose with a correct result."""
    name = rng.choice(NAMES)
    singular, plural = rng.choice(ITEMS)
    a, b = rng.randint(2, 30), rng.randint(1, 20)
    if rng.random() < 0.5:
        return (f"{name} had {a} {plural}. At {rng.choice(PLACES)}, {name} got "
                f"{b} more. Now {name} has {a} + {b} = {a + b} {plural}.")
    a, b = max(a, b) + 1, min(a, b)
    return (f"{name} had {a} {plural}. {name} gave {b} to a friend. {name} has {a} - {b} = {a - b} "
            f"{plural if a - b != 1 else singular} left.")


def story(rng: random.Random, about: str | None = None) -> str:
    """A few sentences of simple narrative prose; when `about` (a creature) is given, the first
    sentence introduces it."""
    name, creature, adj = rng.choice(NAMES), about or rng.choice(CREATURES), rng.choice(ADJECTIVES)
    place, day, month, weather = rng.choice(PLACES), rng.choice(DAYS), rng.choice(MONTHS), rng.choice(WEATHER)
    openings = [f"Once upon a time, {article(adj)} {adj} {creature} named {name} lived near {place}.",
                f"There was once {article(adj)} {adj} {creature} named {name} who loved {place}."]
    if about is None:
        openings.append(f"On a {weather} {day} in {month}, {name} walked to {place}.")
    sentences = [rng.choice(openings)]
    for _ in range(rng.randint(2, 5)):
        other = rng.choice(ADJECTIVES)
        (job, does), (tool, use) = rng.choice(JOBS), rng.choice(TOOLS)
        sentences.append(rng.choice((
            f"One morning, {name} {rng.choice(DEEDS)}.",
            f"Later, {name} {rng.choice(DEEDS)} and felt {rng.choice(FEELINGS)}.",
            f"The weather was {rng.choice(WEATHER)}, so {name} stayed close to {rng.choice(PLACES)}.",
            f"{capitalise(article(other))} {other} {rng.choice(CREATURES)} came by and asked for directions.",
            f"By {rng.choice(SEASONS)}, everyone in {rng.choice(PLACES)} knew the {adj} {creature}.",
            f"{name} said, \"Thank you, friend. I will remember this {rng.choice(SEASONS)}.\"",
            f"{name} {rng.choice(ADVERBS)} {rng.choice(DEEDS)}.",
            f"Every {rng.choice(DAYS)}, {name} enjoyed {rng.choice(HOBBIES)}.",
            f"For dinner there was {rng.choice(FOODS)}, and {name} ate it {rng.choice(ADVERBS)}.",
            f"{name} met {with_article(job)} who {does}.",
            f"{name} borrowed {with_article(tool)} to {use}.",
            f"{name} took the train from {rng.choice(CAPITALS)[1]} to {rng.choice(CAPITALS)[1]}.",
            f"Near {rng.choice(PLACES)}, {name} noticed {with_article(rng.choice(ADJECTIVES))} "
            f"{rng.choice(CREATURES)} eating {rng.choice(FOODS)}.",
        )))
    ending = f"From then on, {name} felt {rng.choice(FEELINGS)} every {rng.choice(SEASONS)}."
    sentences.append(rng.choice(("And that is how the story ends.", "The end.", ending)))
    return " ".join(sentences)


def facts_paragraph(rng: random.Random) -> str:
    """A paragraph stating several facts from the tables."""
    lines = []
    for _ in range(rng.randint(3, 7)):
        lines.append(rng.choice((fact_qa, list_qa, comparison_qa, world_qa))(rng)[1])
    return " ".join(lines)


def list_document(rng: random.Random) -> str:
    """A plain bulleted or numbered list."""
    title, items = rng.choice((
        ("Days of the week", DAYS), ("Months of the year", MONTHS), ("The four seasons", SEASONS),
        ("The planets", PLANETS), ("Colours", COLOURS),
        ("Numbers", tuple(number_words(n) for n in range(rng.randint(0, 80), 100, rng.randint(1, 9)))),
    ))
    if rng.random() < 0.5:
        body = "\n".join(f"{i}. {item}" for i, item in enumerate(items, 1))
    else:
        body = "\n".join(f"- {item}" for item in items)
    return f"{title}:\n{body}"


def multibyte_prose(rng: random.Random) -> str:
    """A couple of lines containing accented letters, CJK or emoji."""
    return "\n".join(rng.sample(MULTIBYTE_LINES, rng.randint(1, 3)))


def dialogue(rng: random.Random) -> str:
    """A ChatML conversation of one to three turns."""
    makers = (arithmetic_qa, comparison_qa, list_qa, fact_qa, world_qa, howto_qa, greeting_qa,
              translation_qa, identity_qa, off_topic_qa, story_qa, describe_qa)
    weights = (5, 2, 2, 4, 4, 1, 3, 1, 1, 1, 2, 2)
    return chat(rng, [rng.choices(makers, weights)[0](rng) for _ in range(rng.randint(1, 3))])


def ordinal(n: int) -> str:
    """1 -> 'first', 2 -> 'second', ... up to 12."""
    return ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth",
            "eleventh", "twelfth")[n - 1]


def join_list(items: tuple[str, ...] | list[str]) -> str:
    """'a, b and c'."""
    return ", ".join(items[:-1]) + " and " + items[-1]


def article(word: str) -> str:
    """'a' or 'an' for the word that follows (by its first letter, which suits this vocabulary)."""
    return "an" if word[0] in "aeiou" else "a"


def with_article(word: str) -> str:
    """'an apple', 'a pear'."""
    return f"{article(word)} {word}"


def capitalise(text: str) -> str:
    """Upper-cases the first character only."""
    return text[:1].upper() + text[1:]


DOCUMENT_KINDS: tuple[tuple[Callable[[random.Random], str], int], ...] = (
    (dialogue, 60), (story, 16), (facts_paragraph, 12), (word_problem, 8), (list_document, 4),
    (multibyte_prose, 2),
)


def make_corpus(seed: int, target_bytes: int) -> str:
    """Documents drawn until the UTF-8 size reaches `target_bytes`; each ends with END_OF_TEXT + newline."""
    rng = random.Random(seed)
    kinds, weights = zip(*DOCUMENT_KINDS, strict=True)
    docs, size = [], 0
    while size < target_bytes:
        doc = rng.choices(kinds, weights)[0](rng) + END_OF_TEXT + "\n"
        docs.append(doc)
        size += len(doc.encode())
    return "".join(docs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=20240607)
    parser.add_argument("--target-bytes", type=int, default=600_000)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    text = make_corpus(args.seed, args.target_bytes)
    args.out.write_text(text, encoding="utf-8", newline="\n")
    print(f"wrote {len(text.encode())} bytes to {args.out}")


if __name__ == "__main__":
    main()
