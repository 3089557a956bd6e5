"""The ``math`` domain: seeded arithmetic word problems with worked solutions ending in "The answer is N.";
every step is an exact integer equation a test can recompute.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from tqdm.auto import tqdm

from angelspec.data.corpus.common import Example

_NAMES = ("Ava", "Ben", "Chloe", "Daniel", "Emma", "Farid", "Grace", "Hugo", "Isla", "Jamal", "Kira", "Liam",
          "Maya", "Noah", "Olivia", "Priya", "Quinn", "Ravi", "Sofia", "Tom", "Uma", "Victor", "Wen", "Yusuf",
          "Zoe")
_ITEMS = (  # (plural, lowest price, highest price) in whole dollars
    ("notebooks", 2, 6), ("pens", 1, 3), ("apples", 1, 2), ("sandwiches", 4, 9), ("books", 8, 25),
    ("tickets", 5, 15), ("shirts", 10, 30), ("bags of rice", 3, 8), ("plants", 4, 12), ("toy cars", 3, 10),
    ("mugs", 4, 11), ("packs of cards", 2, 7),
)
_THINGS = ("marbles", "stickers", "cookies", "cards", "pencils", "stamps", "shells", "beads", "candies", "coins")
_GAIN = ("gets {v} more from {other}", "buys {v} more", "finds {v} more", "wins {v} more in a game")
_LOSE = ("gives {v} to {other}", "loses {v}", "trades away {v}", "gives {v} away")


def _shopping(rng: random.Random) -> tuple[str, list[str], int]:
    name = rng.choice(_NAMES)
    (i1, lo1, hi1), (i2, lo2, hi2) = rng.sample(_ITEMS, 2)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    p1, p2 = rng.randint(lo1, hi1), rng.randint(lo2, hi2)
    x, y = a * p1, b * p2
    total = x + y
    q = f"{name} buys {a} {i1} for ${p1} each and {b} {i2} for ${p2} each."
    steps = [
        f"The {i1} cost {a} × {p1} = {x} dollars.",
        f"The {i2} cost {b} × {p2} = {y} dollars.",
        f"Together they cost {x} + {y} = {total} dollars.",
    ]
    if rng.random() < 0.5:
        bill = next(v for v in (20, 50, 100, 200, 500, 1000) if v > total)
        q += f" {name} pays with a ${bill} bill. How much change does {name} get, in dollars?"
        steps.append(f"The change is {bill} - {total} = {bill - total} dollars.")
        return q, steps, bill - total
    q += rng.choice((f" How much does {name} spend in total, in dollars?", " What is the total cost in dollars?"))
    return q, steps, total


def _sharing(rng: random.Random) -> tuple[str, list[str], int]:
    name, things = rng.choice(_NAMES), rng.choice(_THINGS)
    k, each = rng.randint(2, 9), rng.randint(2, 15)
    rest = rng.randint(0, k - 1)
    n = k * each + rest
    variant = rng.choice(("each", "left", "boxes"))
    if variant == "each":
        q = (f"{name} has {n} {things} and shares them equally among {k} friends, giving each friend as many "
             f"as possible. How many {things} does each friend get?")
        steps = [f"{k} × {each + 1} = {k * (each + 1)} is more than {n}, but {k} × {each} = {k * each} is not."]
        if rest:
            steps.append(f"Set aside the {rest} left over: {n} - {rest} = {k * each}.")
        steps.append(f"Share the rest equally: {k * each} ÷ {k} = {each}.")
        return q, steps, each
    if variant == "left":
        q = (f"{name} shares {n} {things} equally among {k} friends, giving each friend as many as possible. "
             f"How many {things} are left over?")
        steps = [
            f"{k} × {each} = {k * each}, while {k} × {each + 1} = {k * (each + 1)} is more than {n}, "
            f"so each friend gets {each}.",
            f"Left over: {n} - {k * each} = {rest}.",
        ]
        return q, steps, rest
    q = f"{n} {things} are packed into boxes that hold {k} each. How many boxes are needed to hold all of them?"
    if rest == 0:
        return q, [f"{n} ÷ {k} = {each}, so the boxes are filled exactly."], each
    steps = [
        f"{k} × {each} = {k * each} fit into {each} full boxes, leaving {n} - {k * each} = {rest}.",
        f"The {rest} left over need one more box: {each} + 1 = {each + 1}.",
    ]
    return q, steps, each + 1


def _add_subtract(rng: random.Random) -> tuple[str, list[str], int]:
    name, things = rng.choice(_NAMES), rng.choice(_THINGS)
    others = [n for n in _NAMES if n != name]
    cur = rng.randint(10, 80)
    q_parts = [f"{name} has {cur} {things}."]
    steps = [f"{name} starts with {cur}."]
    leads = ("First", "Then", "After that", "Later")
    n_events = rng.randint(2, 4)
    for i in range(n_events):
        lead = "Finally" if i == n_events - 1 else leads[i]
        if cur > 3 and rng.random() < 0.5:
            v = rng.randint(1, cur - 1)
            phrase = rng.choice(_LOSE).format(v=v, other=rng.choice(others))
            steps.append(f"{cur} - {v} = {cur - v}.")
            cur -= v
        else:
            v = rng.randint(2, 30)
            phrase = rng.choice(_GAIN).format(v=v, other=rng.choice(others))
            steps.append(f"{cur} + {v} = {cur + v}.")
            cur += v
        q_parts.append(f"{lead} {name} {phrase}.")
    q_parts.append(f"How many {things} does {name} have now?")
    return " ".join(q_parts), steps, cur


def _percentages(rng: random.Random) -> tuple[str, list[str], int]:
    variant = rng.choice(("discount", "score", "growth"))
    if variant == "discount":
        item = rng.choice(("jacket", "bicycle", "lamp", "camera", "backpack", "chair", "watch"))
        price, rate = 20 * rng.randint(1, 25), rng.choice((10, 15, 20, 25, 30, 40, 50, 75))
        off = price * rate // 100
        q = f"A {item} costs ${price}. It is on sale for {rate}% off. What is the sale price in dollars?"
        steps = [f"The discount is {rate}% of {price}: {price} × {rate} ÷ 100 = {off} dollars.",
                 f"The sale price is {price} - {off} = {price - off} dollars."]
        return q, steps, price - off
    if variant == "score":
        name, total = rng.choice(_NAMES), rng.choice((10, 20, 25, 50))
        right = rng.randint(total // 3, total)
        pct = right * 100 // total
        q = f"{name} answered {right} out of {total} questions correctly on a test. What percentage is that?"
        return q, [f"The percentage is {right} × 100 ÷ {total} = {pct}."], pct
    town, rate = 100 * rng.randint(5, 90), rng.randint(2, 30)
    grow = town * rate // 100
    q = f"A town has {town} people. Next year the population grows by {rate}%. How many people live there then?"
    steps = [f"The increase is {town} × {rate} ÷ 100 = {grow} people.",
             f"The new population is {town} + {grow} = {town + grow}."]
    return q, steps, town + grow


def _rates(rng: random.Random) -> tuple[str, list[str], int]:
    variant = rng.choice(("distance", "production", "reading", "tap", "two_legs"))
    name = rng.choice(_NAMES)
    if variant == "distance":
        speed, hours = 5 * rng.randint(6, 18), rng.randint(2, 6)
        q = f"A train travels at {speed} km per hour for {hours} hours. How many kilometres does it travel?"
        return q, [f"Distance = speed × time = {speed} × {hours} = {speed * hours} km."], speed * hours
    if variant == "production":
        rate, hours = rng.randint(3, 20), rng.randint(2, 12)
        total = rate * hours
        q = f"A machine makes {rate} toys per hour. How many hours does it take to make {total} toys?"
        return q, [f"Time = toys ÷ rate = {total} ÷ {rate} = {hours} hours."], hours
    if variant == "reading":
        per_day, days, done = rng.randint(5, 40), rng.randint(2, 15), rng.randint(10, 120)
        pages = done + per_day * days
        q = (f"{name}'s book has {pages} pages and {name} has already read {done} of them. "
             f"If {name} reads {per_day} pages a day, how many more days will it take to finish the book?")
        steps = [f"Pages left: {pages} - {done} = {pages - done}.",
                 f"Days needed: {pages - done} ÷ {per_day} = {days}."]
        return q, steps, days
    if variant == "tap":
        litres, hours = rng.randint(2, 15), rng.randint(1, 5)
        q = f"A tap fills a tank at {litres} litres per minute. How many litres does it fill in {hours} hours?"
        steps = [f"{hours} hours is {hours} × 60 = {hours * 60} minutes.",
                 f"Water: {hours * 60} × {litres} = {hours * 60 * litres} litres."]
        return q, steps, hours * 60 * litres
    s1, t1, s2, t2 = 10 * rng.randint(3, 9), rng.randint(1, 4), 10 * rng.randint(3, 9), rng.randint(1, 4)
    d1, d2 = s1 * t1, s2 * t2
    q = (f"{name} drives at {s1} km per hour for {t1} hours, then at {s2} km per hour for {t2} hours. "
         f"How far does {name} drive in total, in kilometres?")
    steps = [f"First part: {s1} × {t1} = {d1} km.", f"Second part: {s2} × {t2} = {d2} km.",
             f"Total: {d1} + {d2} = {d1 + d2} km."]
    return q, steps, d1 + d2


def _equations(rng: random.Random) -> tuple[str, list[str], int]:
    variant = rng.choice(("think", "solve_plus", "solve_minus", "sum_diff", "ages"))
    a, x = rng.randint(2, 9), rng.randint(2, 30)
    if variant == "think":
        b = rng.randint(1, 40)
        c = a * x + b
        q = f"I think of a number, multiply it by {a} and then add {b}. The result is {c}. What is my number?"
        steps = [f"Undo the addition: {c} - {b} = {a * x}.", f"Undo the multiplication: {a * x} ÷ {a} = {x}."]
        return q, steps, x
    if variant == "solve_plus":
        b = rng.randint(1, 50)
        c = a * x + b
        q = f"Solve for x: {a}x + {b} = {c}."
        steps = [f"Subtract {b} from both sides: {a}x = {c} - {b} = {a * x}.",
                 f"Divide both sides by {a}: x = {a * x} ÷ {a} = {x}."]
        return q, steps, x
    if variant == "solve_minus":
        b = rng.randint(1, a * x - 1)
        c = a * x - b
        q = f"Solve for x: {a}x - {b} = {c}."
        steps = [f"Add {b} to both sides: {a}x = {c} + {b} = {a * x}.",
                 f"Divide both sides by {a}: x = {a * x} ÷ {a} = {x}."]
        return q, steps, x
    if variant == "sum_diff":
        small, diff = rng.randint(1, 60), rng.randint(1, 40)
        big, total = small + diff, 2 * small + diff
        q = f"Two numbers add up to {total} and differ by {diff}. What is the larger number?"
        steps = [f"Take away the difference: {total} - {diff} = {2 * small}.",
                 f"Split it in half to get the smaller number: {2 * small} ÷ 2 = {small}.",
                 f"Add the difference back: {small} + {diff} = {big}."]
        return q, steps, big
    older, younger = rng.sample(_NAMES, 2)
    young_age, years = rng.randint(2, 15), rng.randint(1, 20)
    now = a * young_age
    q = (f"{older} is {a} times as old as {younger}. {younger} is {young_age} years old. "
         f"How old will {older} be in {years} years?")
    steps = [f"{older} is {a} × {young_age} = {now} years old now.",
             f"In {years} years: {now} + {years} = {now + years}."]
    return q, steps, now + years


MATH_TEMPLATES: dict[str, Callable[[random.Random], tuple[str, list[str], int]]] = {
    "shopping": _shopping,
    "sharing": _sharing,
    "add_subtract": _add_subtract,
    "percentages": _percentages,
    "rates": _rates,
    "equations": _equations,
}


@dataclass(frozen=True)
class MathProblem:
    """A generated word problem; ``solution`` ends with the line ``The answer is {answer}.``"""

    kind: str
    question: str
    solution: str
    answer: int


def generate_math_problems(n: int, *, seed: int = 0) -> list[MathProblem]:
    """``n`` distinct problems, cycling through the templates; deterministic given ``seed``.

    Every equation written in a solution has the form ``a op b [op c] = r`` with exact integer
    arithmetic (divisions are exact by construction), so a test can recompute each step.
    """
    rng = random.Random(f"math:{seed}")
    kinds = list(MATH_TEMPLATES)
    seen: set[str] = set()
    out: list[MathProblem] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 20 * n + 1000:
            raise RuntimeError(f"math generator could only make {len(out)} distinct problems out of {n}")
        kind = kinds[len(out) % len(kinds)] if rng.random() < 0.5 else rng.choice(kinds)
        question, steps, answer = MATH_TEMPLATES[kind](rng)
        if question in seen:
            continue
        seen.add(question)
        out.append(MathProblem(kind, question, "\n".join([*steps, f"The answer is {answer}."]), answer))
    return out


def build_math_examples(n: int, *, seed: int, progress: bool = True) -> list[Example]:
    problems = generate_math_problems(n, seed=seed)
    return [
        Example(p.question, ({"role": "user", "content": p.question}, {"role": "assistant", "content": p.solution}))
        for p in tqdm(problems, desc="math: generate", unit="problem", disable=not progress)
    ]
