"""Built-in benchmark prompts, written for this project in the style of each model-card dataset.

They are not the datasets (pass the real files with `--dataset NAME=FILE.jsonl`); they give each
category its kind of text: competition math, grade-school word problems, proofs and derivations,
Python function completions, short programming tasks and open-ended chat.
"""

from __future__ import annotations

AIME25 = [
    "Find the number of ordered pairs of positive integers (a, b) with a + b = 1000 such that neither a nor b "
    "has a zero digit. Give the final answer as an integer between 0 and 999.",
    "Let S be the set of positive integers n such that n^2 + 12n - 2007 is a perfect square. Find the remainder "
    "when the sum of the elements of S is divided by 1000.",
    "A regular 12-gon is inscribed in a circle of radius 1. Find the number of triangles with vertices among the "
    "12 vertices of the polygon that contain the center of the circle in their interior.",
    "Find the least positive integer n such that 2^n + 5^n - n is a multiple of 1000.",
    "In triangle ABC, AB = 13, BC = 14 and CA = 15. Let D be the foot of the altitude from A and let M be the "
    "midpoint of AD. Find 100 times the square of the distance from M to the circumcenter of ABC.",
]

GSM8K = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
    "clips did Natalia sell altogether in April and May?",
    "A baker makes 3 batches of cookies each day. Each batch has 24 cookies. He sells the cookies in boxes of 6 "
    "for $4 a box. How much money does he make in a 5-day week if he sells every cookie?",
    "Tom is 4 years older than his sister. In 6 years the sum of their ages will be 40. How old is Tom now?",
    "A train leaves at 9:15 am and travels 210 miles at 60 miles per hour, then stops for 20 minutes, then travels "
    "another 90 miles at 45 miles per hour. At what time does it arrive?",
    "Maria buys 5 notebooks at $2.50 each and 3 pens at $1.20 each. She pays with a $20 bill. How much change "
    "does she get back?",
]

MATH500 = [
    "Prove that the sum of the first n odd positive integers equals n^2, then use it to compute "
    "1 + 3 + 5 + ... + 199.",
    "Find all real solutions of the equation sqrt(x + 7) = x - 5. Show each step and check for extraneous roots.",
    "The polynomial x^3 - 6x^2 + 11x - 6 has three real roots r, s and t. Compute r^2 + s^2 + t^2 and "
    "1/r + 1/s + 1/t.",
    "How many positive divisors does 2^4 * 3^3 * 5^2 have, and what is the sum of those divisors? Express the "
    "answer in simplest form.",
    "Let f(x) = (2x + 3) / (x - 1). Find the inverse function f^{-1}(x) and state its domain.",
]

HUMANEVAL = [
    'from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n    """Check '
    "if in the given list of numbers any two numbers are closer to each other than the given threshold.\n"
    '    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)\n    False\n    >>> has_close_elements([1.0, 2.8, 3.0, 4.0], 0.3)\n'
    '    True\n    """\n',
    'def is_palindrome(text: str) -> bool:\n    """Return True if the string reads the same forwards and backwards,\n'
    "    ignoring case and non-alphanumeric characters.\n    >>> is_palindrome('A man, a plan, a canal: Panama')\n"
    '    True\n    >>> is_palindrome(\'hello\')\n    False\n    """\n',
    'from typing import List\n\n\ndef running_max(numbers: List[int]) -> List[int]:\n    """From a list of integers, '
    "return the list of the maximum element seen so far at each position.\n    >>> running_max([1, 2, 3, 2, 3, 4, 2])\n"
    '    [1, 2, 3, 3, 3, 4, 4]\n    """\n',
    'def count_vowels(word: str) -> int:\n    """Return the number of vowels in the word. The vowels are a, e, i, o, u,\n'
    "    and y only when it is the last letter.\n    >>> count_vowels('abcde')\n    2\n    >>> count_vowels('ACEDY')\n"
    '    3\n    """\n',
    'def fib4(n: int) -> int:\n    """The Fib4 sequence is defined as fib4(0) = 0, fib4(1) = 0, fib4(2) = 2, fib4(3) = 0\n'
    "    and fib4(n) = fib4(n-1) + fib4(n-2) + fib4(n-3) + fib4(n-4). Compute the n-th element without recursion.\n"
    '    >>> fib4(5)\n    4\n    >>> fib4(6)\n    8\n    """\n',
]

MBPP = [
    "Write a Python function to find the minimum cost path to reach (m, n) from (0, 0) in a given cost matrix, "
    "moving only right, down or diagonally down-right. Your code should pass: assert min_cost([[1, 2, 3], "
    "[4, 8, 2], [1, 5, 3]], 2, 2) == 8",
    "Write a function to find the shared elements of two lists and return them as a sorted tuple. Your code "
    "should pass: assert similar_elements((3, 4, 5, 6), (5, 7, 4, 10)) == (4, 5)",
    "Write a Python function to check whether a number is a power of two using bit manipulation. Your code "
    "should pass: assert is_power_of_two(16) == True",
    "Write a function that removes all duplicate words from a sentence while keeping the first occurrence of "
    "each. Your code should pass: assert dedupe_words('a b a c b') == 'a b c'",
    "Write a function to compute the n-th Catalan number using dynamic programming. Your code should pass: "
    "assert catalan(5) == 42",
]

ARENA_HARD = [
    "I run a small bakery and want to start selling online. Write a practical plan for the first three months, "
    "covering the website, delivery, pricing and how to measure whether it is working.",
    "Explain the difference between a process and a thread to a junior developer, with an analogy, a short "
    "code example in any language, and the most common mistakes people make with each.",
    "Write a short story (about 300 words) about a lighthouse keeper who discovers that the light has been "
    "signalling to someone on the other side of the sea.",
    "Compare PostgreSQL and SQLite for a mobile app backend that syncs data between devices. Give a "
    "recommendation and the trade-offs that would change your mind.",
    "My team keeps missing deadlines because requirements change late. As an experienced engineering manager, "
    "what would you change in our process, and how would you introduce the changes without slowing us down?",
]

# Built-in name -> (model-card display name, prompts).
BUILTIN = {
    "aime25": ("AIME25", AIME25),
    "gsm8k": ("GSM8K", GSM8K),
    "math500": ("MATH500", MATH500),
    "humaneval": ("HumanEval", HUMANEVAL),
    "mbpp": ("MBPP", MBPP),
    "arena-hard-v2": ("Arena-Hard-v2", ARENA_HARD),
}
