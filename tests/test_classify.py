"""The `auto` complexity classifier (SPEC §4): judge-prompt accuracy, rules, header, odd input."""

from __future__ import annotations

import itertools
import json
import math
import re
import urllib.parse
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gateway.classify as classify_module
from gateway.classify import (
    ALGORITHM_NAMES,
    MODEL_BIAS,
    MODEL_WEIGHTS,
    QUESTION_FORMS,
    SCAN_CHARS,
    ComplexityClassifier,
    PromptText,
    header_value,
    parse_header_value,
)
from gateway.config import Classifier, parse_config

DATA_DIR = Path(__file__).parent / "data"


def load(name: str) -> list[dict[str, str]]:
    text = (DATA_DIR / name).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# The project's labelled judge prompts, the set the rules were first written against.
ROWS = load("judge_prompts.jsonl")
# More labelled prompts, written to tune the built-in vocabulary (rule 5) on: the tuning set.
DEV_ROWS = load("judge_prompts_dev.jsonl")
# Written before the vocabulary existed and never used to tune it: only measured, once.
HELDOUT_ROWS = load("judge_prompts_heldout.jsonl")

DEFAULT = ComplexityClassifier()


def chat(*user: str, system: str | None = None) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if system is not None:
        messages.append({"role": "system", "content": system})
    messages.extend({"role": "user", "content": text} for text in user)
    return {"model": "judge", "messages": messages}


def classify(text: str, classifier: ComplexityClassifier = DEFAULT) -> tuple[str, str]:
    return classifier.classify(chat(text))


def fenced(lines: int, lang: str = "cpp") -> str:
    body = "\n".join(f"    total += a[{i}] * b[{i}];" for i in range(lines))
    return f"```{lang}\n{body}\n```"


# --- the labelled judge prompts -------------------------------------------------------------


@pytest.mark.parametrize("rows", [ROWS, DEV_ROWS, HELDOUT_ROWS], ids=["train", "dev", "heldout"])
def test_dataset_is_a_balanced_labelled_set(rows: list[dict[str, str]]) -> None:
    assert len(rows) >= 80
    for row in rows:
        assert set(row) == {"prompt", "label", "lang"}, row
        assert row["label"] in ("simple", "complex") and row["lang"] in ("en", "zh"), row
        assert row["prompt"].strip(), row
    assert len({row["prompt"] for row in rows}) == len(rows), "duplicate prompts"
    by = Counter((row["lang"], row["label"]) for row in rows)
    # About half English and half Chinese, both labels well represented in each.
    for lang in ("en", "zh"):
        assert by[(lang, "simple")] + by[(lang, "complex")] >= 0.4 * len(rows), by
        assert min(by[(lang, "simple")], by[(lang, "complex")]) >= 0.3 * len(rows) / 2, by


def test_the_three_sets_do_not_share_prompts() -> None:
    train, dev, heldout = (
        {" ".join(r["prompt"].split()) for r in s} for s in (ROWS, DEV_ROWS, HELDOUT_ROWS)
    )
    assert not train & dev and not train & heldout and not dev & heldout
    assert len(HELDOUT_ROWS) >= 120
    assert sum(r["label"] == "complex" for r in HELDOUT_ROWS) >= 0.4 * len(HELDOUT_ROWS)


class Scores:
    """Complex recall, simple precision, simple recall and accuracy of one classifier on a set,
    overall and per language (the team's targets are the first two: a complex prompt sent to
    the light pool is the expensive mistake)."""

    def __init__(self, classifier: ComplexityClassifier, rows: list[dict[str, str]]) -> None:
        # (group, label, decision) -> count; groups "en", "zh" and "all"
        self.counts: Counter[tuple[str, str, str]] = Counter()
        self.wrong: list[str] = []
        for row in rows:
            complexity, rule = classifier.classify(chat(row["prompt"]))
            for group in (row["lang"], "all"):
                self.counts[(group, row["label"], complexity)] += 1
            if complexity != row["label"]:
                head = " ".join(row["prompt"].split())[:90]
                self.wrong.append(f"[{row['lang']}] want {row['label']}, got {rule}: {head}")

    def ratio(
        self, group: str, numerator: tuple[str, str], denominator: list[tuple[str, str]]
    ) -> float:
        total = sum(self.counts[(group, *key)] for key in denominator)
        return self.counts[(group, *numerator)] / total if total else 1.0

    def complex_recall(self, group: str = "all") -> float:
        both = [("complex", "complex"), ("complex", "simple")]
        return self.ratio(group, ("complex", "complex"), both)

    def simple_precision(self, group: str = "all") -> float:
        both = [("simple", "simple"), ("complex", "simple")]
        return self.ratio(group, ("simple", "simple"), both)

    def simple_recall(self, group: str = "all") -> float:
        both = [("simple", "simple"), ("simple", "complex")]
        return self.ratio(group, ("simple", "simple"), both)

    def accuracy(self, group: str = "all") -> float:
        right = [("complex", "complex"), ("simple", "simple")]
        everything = [*right, ("complex", "simple"), ("simple", "complex")]
        return sum(self.counts[(group, *k)] for k in right) / sum(
            self.counts[(group, *k)] for k in everything
        )

    def report(self) -> str:
        lines = ["group  complex-recall  simple-precision  simple-recall  accuracy"]
        for group in ("en", "zh", "all"):
            recall, precision = self.complex_recall(group), self.simple_precision(group)
            lines.append(
                f"{group:5}  {recall:14.1%}  {precision:16.1%}"
                f"  {self.simple_recall(group):13.1%}  {self.accuracy(group):8.1%}"
            )
        return "\n".join([*lines, "misclassified:", *self.wrong])


def test_accuracy_on_judge_prompts_with_the_default_config() -> None:
    scores = Scores(DEFAULT, ROWS)
    print(scores.report())
    # 94.2 % before the built-in vocabulary, 97.1 % with it.
    assert scores.accuracy() >= 0.95, scores.report()
    # Neither language may carry the other.
    assert min(scores.accuracy("en"), scores.accuracy("zh")) >= 0.90, scores.report()
    assert scores.complex_recall() >= 0.95 and scores.simple_precision() >= 0.95, scores.report()


def test_tuning_set_with_the_default_config() -> None:
    """The set the vocabulary was tuned on: a check that it still does what it was tuned to."""
    scores = Scores(DEFAULT, DEV_ROWS)
    print(scores.report())
    for group in ("en", "zh"):
        assert scores.complex_recall(group) >= 0.95, scores.report()
        assert scores.simple_precision(group) >= 0.95, scores.report()
    assert scores.accuracy() >= 0.95, scores.report()


# --- rules ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # complex keywords, English: whole words, case-insensitive, common endings
        ("What is the worst-case time complexity of this code?", ("complex", "keyword=worst-case")),
        ("what's the worst case here", ("complex", "keyword=worst case")),
        ("Prove that this greedy is optimal.", ("complex", "keyword=prove")),
        ("Is it provable that the loop terminates?", ("complex", "keyword=prove")),
        ("Proving the invariant is the hard part", ("complex", "keyword=prove")),
        ("Any optimization ideas for this DP?", ("complex", "keyword=optimize")),
        ("State the time complexities of both loops", ("complex", "keyword=time complexity")),
        ("What's the Big O of this?", ("complex", "keyword=big-o")),
        ("请prove一下这个结论", ("complex", "keyword=prove")),
        # ... but not inside other words, nor near-misses
        ("Can you improve the variable names?", ("simple", "default")),
        ("Please approve my pull request", ("simple", "default")),
        ("What is the optimal way to read a line in C++?", ("simple", "default")),
        ("proofread my comments", ("simple", "default")),
        # complex keywords, Chinese: substrings
        ("这段代码的时间复杂度是多少", ("complex", "keyword=时间复杂度")),
        ("证明这个贪心是对的", ("complex", "keyword=证明")),
        ("最坏情况下会超时吗", ("complex", "keyword=最坏情况")),
        # asymptotic notation
        ("Can this O(n^2) loop pass n = 10^6?", ("complex", "big_o=O(n^2)")),
        ("is it O(n log(n)) overall", ("complex", "big_o=O(n log(n))")),
        ("这样写是O（n）吗", ("complex", "big_o=O（n）")),
        ("my IO(n) helper crashes", ("simple", "default")),
        ("O(∩_∩)O thanks!", ("simple", "default")),
        # simple keywords
        ("does this compile?", ("simple", "keyword=does this compile")),
        ("Does this compile? int main(){return 0;}", ("simple", "keyword=does this compile")),
        ("I get a compiler error on line 3", ("simple", "keyword=compile")),
        ("Fix this syntax error: for i in range(3) print(i)", ("simple", "keyword=syntax")),
        ("这段代码能不能编译", ("simple", "keyword=能不能编译")),
        ("帮我看看有没有语法错误", ("simple", "keyword=语法")),
        # the default
        ("hello", ("simple", "default")),
        ("How do I read input until EOF in Python?", ("simple", "default")),
    ],
)
def test_rule_strings(text: str, expected: tuple[str, str]) -> None:
    assert classify(text) == expected


# --- the built-in vocabulary (rule 5) --------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # algorithm, data-structure and technique names, English: whole words, endings
        ("Is Dijkstra still right if one edge is negative?", ("complex", "algorithm=dijkstra")),
        ("bellman ford or spfa here?", ("complex", "algorithm=bellman-ford")),
        ("My segment-trees give wrong sums", ("complex", "algorithm=segment tree")),
        ("I used union find with path compression", ("complex", "algorithm=union-find")),
        ("why is my greedy wrong", ("complex", "algorithm=greedy")),
        # at one position the longer entry
        ("is the greedy choice safe", ("complex", "algorithm=greedy choice")),
        ("max bipartite matching, 10^5 vertices", ("complex", "algorithm=bipartite")),
        ("count subarrays with sum k", ("complex", "algorithm=subarray")),
        # reasoning question forms, English
        ("Give me a counterexample for this", ("complex", "question=counterexample")),
        ("Can you derive it?", ("complex", "question=derive")),
        ("which algorithm fits here", ("complex", "question=algorithm")),
        ("How should I approach this one", ("complex", "question=approach")),
        ("Is this correct? I sort by end time", ("complex", "question=is this correct")),
        # Chinese: substrings; the entry that occurs first names the rule
        ("这题用线段树还是树状数组", ("complex", "algorithm=线段树")),
        ("推导一下递推式", ("complex", "question=推导")),
        ("给个反例", ("complex", "question=反例")),
        ("这题怎么做", ("complex", "question=怎么做")),
        ("二分图最大匹配用什么算法", ("complex", "algorithm=二分图")),
        # short entries take no endings, and nothing matches inside another word
        ("I tried everything and it tries again", ("simple", "default")),
        ("Is it primed?", ("simple", "default")),
        ("what does the dagger symbol mean", ("simple", "default")),
        # characters that look like an entry in the automaton's CJK form (same continuation
        # bytes, other lead byte) are not the entry
        ("亿宵堑", ("simple", "default")),
        ("需韭緯", ("simple", "default")),
        # plain simple questions stay simple
        ("How do I read two integers in one line?", ("simple", "default")),
        ("什么是指针？", ("simple", "default")),
        ("What does WA mean?", ("simple", "default")),
        ("why does printf print garbage for a long long", ("simple", "default")),
    ],
)
def test_vocabulary_rule_strings(text: str, expected: tuple[str, str]) -> None:
    assert classify(text) == expected


def test_vocabulary_comes_after_both_keyword_lists_and_before_the_size_rules() -> None:
    # A configured simple keyword wins: "does my Dijkstra compile?" is a compile check.
    assert classify("Does my Dijkstra compile?") == ("simple", "keyword=compile")
    assert classify("我的线段树编译不过") == ("simple", "keyword=编译")
    # A configured complex keyword or a bound wins too, and names itself.
    assert classify("prove my greedy is optimal") == ("complex", "keyword=prove")
    assert classify("is my dijkstra O(m log n)?") == ("complex", "big_o=O(m log n)")
    # It beats the size rules: the name says more than the size.
    assert classify("Dijkstra gives WA:\n" + fenced(57)) == ("complex", "algorithm=dijkstra")
    long_text = "Here is the statement of the problem, please read it carefully. " * 80
    assert classify(long_text + " Which algorithm?") == ("complex", "question=algorithm")


def test_vocabulary_inside_code_does_not_count() -> None:
    assert classify("```cpp\nvoid dijkstra(int s) {}\n```\nwhat does this print?") == (
        "simple",
        "default",
    )
    assert classify("void dijkstra(int s);\nwhat does this print") == ("simple", "default")
    assert classify("// 线段树模板\nint x;\n这段输出什么") == ("simple", "default")
    # ... but the same name in the question counts.
    assert classify("// 线段树模板\nint x;\n线段树哪里写错了") == ("complex", "algorithm=线段树")


def test_configured_simple_keywords_override_the_vocabulary() -> None:
    lever = ComplexityClassifier(Classifier(simple_keywords=["template", "模板"]))
    assert classify("segment tree template please", lever) == ("simple", "keyword=template")
    assert classify("给我一个线段树模板", lever) == ("simple", "keyword=模板")
    assert classify("segment tree template please") == ("complex", "algorithm=segment tree")


def test_vocabulary_entries_are_words_or_chinese_and_unique() -> None:
    words = re.compile(r"[a-z0-9]+(?:[ -][a-z0-9]+)*")
    for entry in (*ALGORITHM_NAMES, *QUESTION_FORMS):
        # Pure ASCII words (found by the word automaton) or pure Chinese (found by the same
        # automaton in the CJK form): no entry needs a regex pass over every text.
        chinese = all("\u4e00" <= c <= "\u9fff" for c in entry)
        assert words.fullmatch(entry) or chinese, entry
    assert len(set(ALGORITHM_NAMES) | set(QUESTION_FORMS)) == len(ALGORITHM_NAMES) + len(
        QUESTION_FORMS
    )
    # The default configuration then has no regex-matched substring keyword at all.
    assert DEFAULT.regex_keywords == ()


def test_vocabulary_rules_in_the_header() -> None:
    value = header_value(*classify("这题用线段树吗"))
    assert value == "complex; algorithm=%E7%BA%BF%E6%AE%B5%E6%A0%91"
    assert parse_header_value(value) == ("complex", "algorithm=线段树")
    assert header_value(*classify("Is SPFA fine here?")) == "complex; algorithm=spfa"


# An alphabet for the CJK path: keywords, their lead-byte aliases, parts of them, ASCII,
# a 2-byte and a 4-byte character, whitespace, fences and code-ish lines.
CJK_PIECES = [
    "线段树",
    "亿宵堑",
    "线段",
    "段树",
    "最短路",
    "需韭緯",
    "时间复杂度",
    "复杂度",
    "编译",
    "证明",
    "é",
    "😀",
    "a",
    "dp",
    " ",
    "\n",
    "```",
    "// ",
    "int x;",
    "，",
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(CJK_PIECES), max_size=30).map("".join))
def test_cjk_automaton_finds_exactly_the_substrings(text: str) -> None:
    """The core's automaton over the CJK form, confirmed by `bytes.find`, finds every
    occurrence of every Chinese keyword and nothing else."""
    c = DEFAULT
    t = PromptText([text])
    found = sorted(c.cjk_occurrences(t))
    keywords = set(c.substring_keywords)
    expected = sorted(
        (m.start(), keyword)
        for keyword in keywords
        for m in re.finditer(f"(?={re.escape(keyword)})", t.padded.decode("utf-8"))
    )
    # Positions in `padded` bytes, the expectation's in characters: compare by keyword and
    # by the text in front.
    as_chars = sorted((len(t.padded[:pos].decode("utf-8")), keyword) for pos, keyword in found)
    assert as_chars == expected


def test_the_first_keyword_in_the_text_names_the_rule() -> None:
    assert classify("optimize this, then prove it") == ("complex", "keyword=optimize")
    assert classify("prove it, then optimize it") == ("complex", "keyword=prove")
    assert classify("先优化，再证明") == ("complex", "keyword=优化")
    assert classify("请证明 and optimize") == ("complex", "keyword=证明")
    # At one position the longer keyword: "复杂度分析" rather than a shorter one inside it.
    assert classify("帮我做复杂度分析") == ("complex", "keyword=复杂度分析")


def test_complex_keywords_beat_simple_ones() -> None:
    text = "Fix the syntax error, then tell me the time complexity."
    assert classify(text) == ("complex", "keyword=time complexity")
    assert classify("编译报错了，顺便分析一下时间复杂度") == ("complex", "keyword=时间复杂度")
    assert classify("does this compile? I want O(n log n)") == ("complex", "big_o=O(n log n)")


def test_a_simple_question_over_a_big_paste_is_simple() -> None:
    text = "Does this compile?\n" + fenced(300)
    assert classify(text) == ("simple", "keyword=does this compile")
    assert classify("这段代码有编译错误吗？\n" + fenced(300, "java")) == ("simple", "keyword=编译")


def test_long_prompt() -> None:
    text = "Here is the statement of the problem, please read it carefully. " * 80
    assert len(text) > 4000
    assert classify(text) == ("complex", f"long_prompt={len(text)}")
    # A simple keyword still wins over length: a long statement with a typo fix is simple.
    assert classify(text + " Fix the typos.") == ("simple", "keyword=typo")
    # Exactly at the limit is not long.
    assert classify("x" * 4000) == ("simple", "default")
    assert classify("x" * 4001) == ("complex", "long_prompt=4001")


def test_code_lines_count_fenced_code() -> None:
    assert classify("Why wrong answer on test 3?\n" + fenced(57)) == ("complex", "code_lines=57")
    assert classify("Why wrong answer on test 3?\n" + fenced(39)) == ("simple", "default")
    assert classify("Why wrong answer on test 3?\n" + fenced(40)) == ("complex", "code_lines=40")
    # Several fences add up, blank lines inside count, the info string line does not.
    two = f"first:\n{fenced(20)}\nsecond:\n```\n\n{fenced(19)[7:]}"
    assert classify(two) == ("complex", "code_lines=40")


def test_code_lines_count_unfenced_code() -> None:
    cpp = "\n".join(
        ["#include <bits/stdc++.h>", "using namespace std;", "int main() {", "    int n;"]
        + [f"    long long v{i} = {i};" for i in range(40)]
        + ["    return 0;", "}"]
    )
    complexity, rule = classify(cpp + "\n\nwhy does this print the wrong total?")
    assert (complexity, rule) == ("complex", "code_lines=46")
    python = "\n".join(
        ["import sys", "def main():", "    n = int(sys.stdin.readline())"]
        + [f"    x{i} = n * {i}" for i in range(36)]
        + ["    print(n)", "main()"]
    )
    assert classify(python + "\nwhat is wrong") == ("complex", "code_lines=41")
    # Prose lines are not code, even long ones ending in punctuation.
    prose = "\n".join(f"Line {i} of a long explanation, with commas; and more." for i in range(60))
    assert classify(prose[:3900]) == ("simple", "default")


def test_keywords_inside_code_do_not_count() -> None:
    paste = (
        '#pragma GCC optimize("O3,unroll-loops")\n'
        "#include <bits/stdc++.h>\n"
        "int main() {\n"
        "    // TODO: optimize, prove bound\n"
        "    return 0;\n"
        "}\n"
    )
    assert classify(paste + "does this compile with g++ 9?") == (
        "simple",
        "keyword=does this compile",
    )
    assert classify("Does it compile?\n```cpp\n// worst case O(n^2)\nint x;\n```") == (
        "simple",
        "keyword=compile",
    )
    # The same keyword in the question still counts.
    assert classify(paste + "how do I optimize this?") == ("complex", "keyword=optimize")
    # Notation and Chinese keywords on code lines do not count either.
    assert classify("total = solve(n)  # O(n^2)\ndoes this compile?") == (
        "simple",
        "keyword=does this compile",
    )
    assert classify("// 这里可以优化\nint x;\n这段能编译吗") == ("simple", "keyword=编译")


def test_default_complexity_and_no_text() -> None:
    complex_default = ComplexityClassifier(default_complexity="complex")
    assert classify("hello", complex_default) == ("complex", "default")
    assert complex_default.classify({"messages": []}) == ("complex", "no_text")
    assert DEFAULT.classify({"messages": []}) == ("simple", "no_text")
    with pytest.raises(ValueError):
        ComplexityClassifier(default_complexity="medium")  # type: ignore[arg-type]


# --- configuration --------------------------------------------------------------------------


def test_custom_keyword_lists_change_decisions() -> None:
    text = "My code compiles fine but gets MLE on test 14, where is the bottleneck?"
    assert classify(text) == ("simple", "keyword=compile")
    tuned = ComplexityClassifier(
        Classifier(
            complex_keywords=["MLE", "time limit", "超时", "O(n^2)", "dp"],
            simple_keywords=["compile", "拼写"],
        )
    )
    assert classify(text, tuned) == ("complex", "keyword=MLE")
    assert classify("为什么会超时", tuned) == ("complex", "keyword=超时")
    assert classify("How do I define the DP state?", tuned) == ("complex", "keyword=dp")
    assert classify("what dpi should the plot use", tuned) == ("simple", "default")
    assert classify("输出的拼写对吗", tuned) == ("simple", "keyword=拼写")
    # An ASCII keyword with punctuation matches as a substring, case-insensitively.
    assert classify("is this o(N^2) fine", tuned) == ("complex", "keyword=O(n^2)")
    # Given lists replace the defaults.
    assert classify("Prove that this is optimal", tuned) == ("simple", "default")
    # (The keyword no longer decides; the built-in model, rule 8, still leans complex on the
    # characters of 时间复杂度.)
    assert classify("这段代码的时间复杂度是多少", tuned) == ("complex", "model=1.02(间,度,时)")


def test_custom_sizes_change_decisions() -> None:
    short = ComplexityClassifier(Classifier(long_prompt_chars=100))
    assert classify("a" * 101, short) == ("complex", "long_prompt=101")
    small = ComplexityClassifier(Classifier(code_lines_complex=5))
    assert classify("why WA?\n" + fenced(5), small) == ("complex", "code_lines=5")
    assert classify("why WA?\n" + fenced(5)) == ("simple", "default")


def test_built_from_the_yaml_config() -> None:
    config = parse_config(
        """
pools:
  light: {instances: [{name: a, url: "http://127.0.0.1:9001/v1", model: m, max_concurrency: 1}]}
  heavy: {instances: [{name: b, url: "http://127.0.0.1:9002/v1", model: m, max_concurrency: 1}]}
models:
  judge: {route: auto}
routing:
  complexity: {simple: light, complex: heavy}
  default_complexity: complex
  classifier:
    complex_keywords: [segment tree, 线段树]
    simple_keywords: [indent]
    long_prompt_chars: 50
"""
    )
    c = ComplexityClassifier.from_config(config)
    assert classify("why is my Segment-Tree slow", c) == ("complex", "keyword=segment tree")
    assert classify("线段树懒标记", c) == ("complex", "keyword=线段树")
    assert classify("fix my indentation please", c) == ("simple", "keyword=indent")
    assert classify("hi", c) == ("complex", "default")
    assert classify("z" * 51, c) == ("complex", "long_prompt=51")


def test_keywords_with_control_characters_make_clean_rules() -> None:
    c = ComplexityClassifier(Classifier(complex_keywords=["time\ncomplexity", "证\u200b明"]))
    assert classify("time complexity?", c) == ("complex", "keyword=time complexity")
    complexity, rule = classify("请证明", c)
    assert (complexity, rule) == ("complex", "keyword=证明")


# --- the response header --------------------------------------------------------------------


def test_header_value_is_latin1_and_round_trips() -> None:
    ascii_rule = header_value("complex", "keyword=time complexity")
    assert ascii_rule == "complex; keyword=time complexity"  # ASCII passes unchanged
    value = header_value(*classify("这段代码的时间复杂度是多少"))
    assert value == "complex; keyword=%E6%97%B6%E9%97%B4%E5%A4%8D%E6%9D%82%E5%BA%A6"
    value.encode("latin-1")
    assert parse_header_value(value) == ("complex", "keyword=时间复杂度")
    assert urllib.parse.unquote(value) == "complex; keyword=时间复杂度"
    # "%" itself is escaped, so decoding never changes an ASCII rule that contains one.
    assert parse_header_value(header_value("complex", "keyword=100%")) == (
        "complex",
        "keyword=100%",
    )


@given(st.sampled_from(["simple", "complex"]), st.text(max_size=60))
@settings(max_examples=300)
def test_header_value_is_always_sendable_and_reversible(complexity: str, rule: str) -> None:
    value = header_value(complexity, rule)
    value.encode("latin-1")
    assert all(0x20 <= ord(c) < 0x7F for c in value), value  # no CR, LF or other controls
    assert parse_header_value(value) == (complexity, rule)


# --- the linear model (rule 8) ---------------------------------------------------------------

CJK_RUN = re.compile(r"[\u3400-\u9fff]+")
WORD_PAIR = re.compile(rb"(?=(?:^| )([a-z0-9_]+) ([a-z0-9_]+)(?= |$))")


def model_features(prompt: str) -> set[str]:
    """What the model sees of a prompt, computed the slow and obvious way: the words of the
    prose's word form and pairs of words one space apart, the Chinese characters of the prose
    and pairs of adjacent ones. (The classifier finds the same with the core's automaton.)"""
    text = PromptText([prompt])
    words = text.word_form()
    features = {w.decode() for w in words.split()}
    features |= {f"{a.decode()} {b.decode()}" for a, b in WORD_PAIR.findall(words)}
    for run in CJK_RUN.findall(text.prose):
        features |= set(run)
        features |= {run[i : i + 2] for i in range(len(run) - 1)}
    return features


def train_model(
    rows: list[dict[str, str]],
    penalty: float = 0.01,
    epochs: int = 300,
    rate: float = 0.5,
    min_count: int = 2,
) -> tuple[float, dict[str, float]]:
    """Logistic regression with an L1 penalty (proximal gradient descent, full batch) over the
    presence of `model_features` that occur in at least `min_count` prompts: the bias and the
    weights that are not zero. Deterministic: features are visited in sorted order. The
    settings were chosen by 5-fold cross-validation on the training and tuning sets."""
    xs = [model_features(row["prompt"]) for row in rows]
    ys = [1.0 if row["label"] == "complex" else 0.0 for row in rows]
    counts = Counter(f for x in xs for f in x)
    vocabulary = sorted(f for f, n in counts.items() if n >= min_count)
    kept = set(vocabulary)
    columns = [sorted(f for f in x if f in kept) for x in xs]
    weights = dict.fromkeys(vocabulary, 0.0)
    bias = 0.0
    for _ in range(epochs):
        gradient = dict.fromkeys(vocabulary, 0.0)
        bias_gradient = 0.0
        for x, y in zip(columns, ys, strict=True):
            error = 1.0 / (1.0 + math.exp(-(bias + sum(weights[f] for f in x)))) - y
            bias_gradient += error
            for f in x:
                gradient[f] += error
        bias -= rate * bias_gradient / len(columns)
        for f in vocabulary:
            step = weights[f] - rate * gradient[f] / len(columns)
            weights[f] = math.copysign(max(abs(step) - rate * penalty, 0.0), step)
    return bias, {f: w for f, w in weights.items() if w}


@pytest.fixture(scope="module")
def trained() -> tuple[float, dict[str, float]]:
    # The project's own labelled prompts, never the held-out set.
    return train_model(ROWS + DEV_ROWS)


def test_shipped_model_is_what_training_on_the_labelled_sets_gives(
    trained: tuple[float, dict[str, float]],
) -> None:
    bias, weights = trained
    assert set(weights) == set(MODEL_WEIGHTS)
    assert bias == pytest.approx(MODEL_BIAS, abs=1e-9)
    for feature, weight in weights.items():
        assert weight == pytest.approx(MODEL_WEIGHTS[feature], abs=1e-9), feature


@pytest.mark.parametrize("rows", [ROWS, DEV_ROWS, HELDOUT_ROWS], ids=["train", "dev", "heldout"])
def test_model_scores_in_the_classifier_equal_the_obvious_computation(
    rows: list[dict[str, str]],
) -> None:
    c = DEFAULT
    for row in rows:
        score = c.model_score(PromptText([row["prompt"]]))
        expected = MODEL_BIAS + sum(
            MODEL_WEIGHTS.get(f, 0.0) for f in model_features(row["prompt"])
        )
        assert score == pytest.approx(expected, abs=1e-9), row["prompt"][:60]


def test_model_rule() -> None:
    # It decides only where every rule before it would answer the default, names the
    # features that pulled most, and only ever says complex.
    assert classify("给定一棵树，求两点间最远距离") == ("complex", "model=1.81(最,间,树)")
    text = "Design a way to maintain the median of a multiset under deletions, 10^5 operations."
    complexity, rule = classify(text)
    assert complexity == "complex" and rule.startswith("model=") and rule.endswith("(the,of,10)")
    assert classify("What is the time limit?") == ("simple", "default")
    value = header_value(*classify("给定一棵树，求两点间最远距离"))
    assert parse_header_value(value) == ("complex", "model=1.81(最,间,树)")
    # Any rule before it wins.
    assert classify("给定一棵树，这段能编译吗") == ("simple", "keyword=编译")


# --- held-out evaluation ----------------------------------------------------------------------


def test_heldout_set() -> None:
    """judge_prompts_heldout.jsonl was written before the vocabulary and the model and never
    used to tune them. Measured on it: before (keywords only) complex recall 5.0 %, simple
    precision 55.8 %; with the vocabulary 91.7 % / 93.5 %; with the vocabulary and the model
    96.7 % / 97.3 % (EN and ZH alike), simple recall 100 %. Targets: complex recall and
    simple precision of at least 95 %, overall and per language."""
    scores = Scores(DEFAULT, HELDOUT_ROWS)
    print(scores.report())
    for group in ("en", "zh", "all"):
        assert scores.complex_recall(group) >= 0.95, scores.report()
        assert scores.simple_precision(group) >= 0.95, scores.report()
    assert scores.simple_recall() >= 0.95, scores.report()


def test_heldout_set_without_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same set with the model switched off: the vocabulary alone stays under the
    targets (complex recall 91.7 %, simple precision 93.5 %), which is why the model ships."""
    monkeypatch.setattr(classify_module, "_MODEL_THRESHOLD", math.inf)
    scores = Scores(DEFAULT, HELDOUT_ROWS)
    print(scores.report())
    assert scores.complex_recall() >= 0.90 and scores.simple_precision() >= 0.90, scores.report()
    assert not any("model=" in line for line in scores.wrong)


# --- request shapes -------------------------------------------------------------------------


def test_only_user_messages_are_read() -> None:
    body = chat("hello", system="Always prove your claims and analyse time complexity.")
    assert DEFAULT.classify(body) == ("simple", "default")
    body["messages"].append({"role": "assistant", "content": "The worst case is O(n^2)."})
    assert DEFAULT.classify(body) == ("simple", "default")
    # Every user message counts, not only the last.
    assert DEFAULT.classify(chat("prove it", "thanks")) == ("complex", "keyword=prove")


def test_bodies_without_user_text() -> None:
    bodies: list[dict[str, Any]] = [
        {},
        {"messages": []},
        {"messages": [{"role": "system", "content": "prove everything"}]},
        {"messages": [{"role": "user", "content": ""}]},
        {"messages": [{"role": "user", "content": None}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {"prompt": ""},
        {"prompt": [1, 2, 3]},
        {"prompt": [[1, 2], [3]]},
    ]
    for body in bodies:
        assert DEFAULT.classify(body) == ("simple", "no_text"), body


def test_list_content_parts() -> None:
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look at this picture."},
                    {"type": "image_url", "image_url": {"url": "data:,"}},
                    {"type": "text", "text": "What is its time complexity?"},
                ],
            }
        ]
    }
    assert DEFAULT.classify(body) == ("complex", "keyword=time complexity")
    # Fences are read per part: a fence opened in one part does not swallow the next.
    body["messages"][0]["content"] = [
        {"type": "text", "text": "```cpp\nint x; // unclosed"},
        {"type": "text", "text": "prove it terminates"},
    ]
    assert DEFAULT.classify(body) == ("complex", "keyword=prove")


def test_completions_prompt() -> None:
    assert DEFAULT.classify({"prompt": "prove it"}) == ("complex", "keyword=prove")
    assert DEFAULT.classify({"prompt": ["hello", "证明它"]}) == ("complex", "keyword=证明")
    assert DEFAULT.classify({"prompt": ["does this compile", 7, None]}) == (
        "simple",
        "keyword=does this compile",
    )
    # `messages` wins when both are present: it is a chat body.
    assert DEFAULT.classify({"messages": [], "prompt": "prove it"}) == ("simple", "no_text")


@pytest.mark.parametrize(
    "body",
    [
        {"messages": None, "prompt": None},
        {"messages": "prove it"},
        {"messages": 42},
        {"messages": [None, 3, "x", [], {"role": "user"}, {"role": "user", "content": 5}]},
        {"messages": [{"role": "user", "content": [None, 3, ["nested", ["list"]], {"text": 9}]}]},
        {"messages": [{"role": ["user"], "content": "prove"}]},
        {"messages": [{"role": "user", "content": {"text": "prove"}}]},
        {"prompt": {"text": "prove"}},
        {"prompt": 3.5},
        {"prompt": [["prove it"], None, {"a": 1}]},
    ],
)
def test_odd_bodies_do_not_crash(body: dict[str, Any]) -> None:
    complexity, rule = DEFAULT.classify(body)
    assert complexity in ("simple", "complex") and rule in ("no_text", "default")


def test_odd_text_does_not_crash() -> None:
    for text in [
        "\ud800 lone surrogate, prove it",
        "nul\x00byte optimize",
        "\r\n".join(["int x;"] * 50),
        "```",
        "``````",
        "```\n",
        "O(" * 500,
        "O(n" + ")" * 500,
        "\n" * 10_000,
        "证明" * 5000,
    ]:
        complexity, rule = classify(text)
        assert complexity in ("simple", "complex"), text[:40]
        assert rule.isprintable(), rule


def test_crlf_code_lines_are_counted() -> None:
    paste = "\r\n".join(["int main() {"] + [f"    x += {i};" for i in range(45)] + ["}"])
    assert classify(paste + "\r\nwhy WA") == ("complex", "code_lines=47")


def test_huge_prompt_scans_only_its_ends() -> None:
    filler = "lorem ipsum dolor sit amet " * 20_000
    assert len(filler) > 4 * SCAN_CHARS
    middle = filler + " prove it " + filler
    assert classify(middle) == ("complex", f"long_prompt={len(middle)}")
    assert classify("Please fix the typo: " + middle) == ("simple", "keyword=typo")
    assert classify(middle + " does this compile?") == ("simple", "keyword=does this compile")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)


@given(
    st.dictionaries(
        st.sampled_from(["messages", "prompt", "model"]),
        json_values
        | st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system"]), "content": json_values}
            ),
            max_size=3,
        ),
    )
)
@settings(max_examples=200)
def test_any_json_body_classifies(body: dict[str, Any]) -> None:
    complexity, rule = DEFAULT.classify(body)
    assert complexity in ("simple", "complex")
    assert rule and "\n" not in rule and "\r" not in rule
    assert DEFAULT.classify(body) == (complexity, rule)  # deterministic


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                "dp",
                "dpi",
                "tle",
                "prove",
                "improve",
                "proving",
                "compile",
                "O(n)",
                "复杂度",
                "int",
                "x",
                " ",
                "\n",
                "-",
                "DP",
                "worst-case",
                "```",
                "优化",
                "big-o",
                "syntax!",
                "find",
                "the",
                "n^2",
                "what does",
                "segment tree",
            ]
        ),
        max_size=40,
    ).map(" ".join)
)
def test_core_trigger_search_equals_word_set_intersection(text: str) -> None:
    """The Aho-Corasick trigger search in the core finds exactly the whole words (and the
    model's pairs of words, "find the") that a split of the word form would."""
    c = DEFAULT
    t = PromptText([text])
    form = t.word_form()
    found = c.trigger_hits(t)
    words = form.split()
    pairs = {a + b" " + b for a, b in itertools.pairwise(words)}
    # a pair counts only when its words are one space apart in the form
    pairs = {p for p in pairs if b" " + p + b" " in b" " + form + b" "}
    assert found == c.triggers.intersection({*words, *pairs})


if __name__ == "__main__":
    # Retrain the model and print its weights for python/gateway/classify.py:
    #   .venv/bin/python tests/test_classify.py
    bias, weights = train_model(ROWS + DEV_ROWS)
    print(f"MODEL_BIAS: Final = {bias!r}")
    for feature, weight in sorted(weights.items(), key=lambda fw: (-fw[1], fw[0])):
        print(f"    {feature!r}: {weight!r},")
