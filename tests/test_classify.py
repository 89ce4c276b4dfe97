"""The `auto` complexity classifier (SPEC §4): judge-prompt accuracy, rules, header, odd input."""

from __future__ import annotations

import json
import urllib.parse
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.classify import SCAN_CHARS, ComplexityClassifier, header_value, parse_header_value
from gateway.config import Classifier, parse_config

DATA = Path(__file__).parent / "data" / "judge_prompts.jsonl"
ROWS: list[dict[str, str]] = [
    json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()
]

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


def test_dataset_is_a_balanced_labelled_set() -> None:
    assert len(ROWS) >= 80
    for row in ROWS:
        assert set(row) == {"prompt", "label", "lang"}, row
        assert row["label"] in ("simple", "complex") and row["lang"] in ("en", "zh"), row
        assert row["prompt"].strip(), row
    assert len({row["prompt"] for row in ROWS}) == len(ROWS), "duplicate prompts"
    by = Counter((row["lang"], row["label"]) for row in ROWS)
    # About half English and half Chinese, both labels well represented in each.
    for lang in ("en", "zh"):
        assert by[(lang, "simple")] + by[(lang, "complex")] >= 0.4 * len(ROWS), by
        assert min(by[(lang, "simple")], by[(lang, "complex")]) >= 0.3 * len(ROWS) / 2, by


def test_accuracy_on_judge_prompts_with_the_default_config() -> None:
    correct: Counter[str] = Counter()
    total: Counter[str] = Counter()
    wrong: list[str] = []
    for row in ROWS:
        complexity, rule = DEFAULT.classify(chat(row["prompt"]))
        total[row["lang"]] += 1
        if complexity == row["label"]:
            correct[row["lang"]] += 1
        else:
            head = " ".join(row["prompt"].split())[:90]
            wrong.append(f"[{row['lang']}] want {row['label']}, got {complexity} ({rule}): {head}")
    accuracy = sum(correct.values()) / sum(total.values())
    per_lang = {lang: correct[lang] / total[lang] for lang in sorted(total)}
    report = f"accuracy {accuracy:.1%} " + " ".join(f"{k}={v:.1%}" for k, v in per_lang.items())
    print(report)
    print("\n".join(wrong))
    assert accuracy >= 0.90, report + "; misclassified:\n" + "\n".join(wrong)
    # Neither language may carry the other.
    assert min(per_lang.values()) >= 0.85, report + "; misclassified:\n" + "\n".join(wrong)


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
    assert classify("这段代码的时间复杂度是多少", tuned) == ("simple", "default")


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
            ]
        ),
        max_size=40,
    ).map(" ".join)
)
def test_core_trigger_search_equals_word_set_intersection(text: str) -> None:
    """The Aho-Corasick trigger search in the core finds exactly the whole words a split of
    the word form would."""
    from gateway.classify import _Text

    c = ComplexityClassifier()
    form = _Text([text]).word_form()
    found = frozenset(c._trigger_list[i] for i in c._trigger_search.present(form))
    assert found == c._triggers.intersection(form.split())
