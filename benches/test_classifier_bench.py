"""Cost of the `auto` complexity classifier per request (pytest-benchmark).

    .venv/bin/pytest benches/test_classifier_bench.py --benchmark-only

The three cases of the brief: a ~4 KB English judge prompt, a ~4 KB Chinese one (4000 bytes of
UTF-8, as the request body carries it: about 1,900 characters) and a short one. Each 4 KB prompt
is what a judge sends: part of a problem statement, a fenced solution and a question with no
keyword, so every rule is evaluated before the default answers. Two worst cases follow: 4 KB of
English prose with no code (the word pass costs per word) and 4 KB of unfenced code (counted
line by line). For scale on whatever machine runs this, `test_reference_json_decode` times
decoding the same request body with orjson, which the gateway does for every request anyway.

The 4 KB prompts end in the default, so they pay for every rule: the keyword lists, the
built-in vocabulary (English words and the Chinese pass of the core's automaton) and the
linear model's score. `short-zh-vocabulary` is a short Chinese question decided by the
vocabulary (`algorithm=线段树`).
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.classify import ComplexityClassifier

# Bytes of UTF-8 user text: ~4 KB, and no more than the default `long_prompt_chars` (4000), so
# the English prompts are not decided early by their length and every rule runs.
SIZE = 4000

EN_PROSE = (
    "There are n towers in a row, and the i-th tower has height h_i. A bird starts on the "
    "first tower and wants to reach the last one. From a tower it may fly to any later tower "
    "that is not higher than every tower in between, and each flight costs the difference of "
    "the two heights plus one. The bird is tired, so it asks for the cheapest route. You are "
    "given several test cases; for each of them print the minimum total cost on its own line, "
    "or -1 when the last tower cannot be reached at all. Heights fit in 32-bit integers, and "
    "the sum of n over all test cases does not exceed two hundred thousand.\n"
)
ZH_PROSE = (
    "一排有 n 座塔，第 i 座塔的高度为 h_i。一只鸟从第一座塔出发，想要到达最后一座塔。"
    "它可以从一座塔飞到后面任意一座塔，只要中间的塔都不比出发的塔高，每次飞行的代价是两座塔"
    "高度之差再加一。鸟累了，所以想知道最便宜的路线。输入包含多组数据，对每组数据输出最小的"
    "总代价，如果无法到达最后一座塔则输出 -1。所有 n 之和不超过二十万。\n"
)
CODE = """#include <bits/stdc++.h>
using namespace std;
int main() {
    int t;
    scanf("%d", &t);
    while (t--) {
        int n;
        scanf("%d", &n);
        vector<long long> h(n), best(n, LLONG_MAX);
        for (auto &x : h) scanf("%lld", &x);
        best[0] = 0;
        for (int i = 0; i < n; i++) {
            if (best[i] == LLONG_MAX) continue;
            long long top = h[i];
            for (int j = i + 1; j < n; j++) {
                if (h[j] <= top) best[j] = min(best[j], best[i] + top - h[j] + 1);
                if (h[j] > top) break;
            }
        }
        printf("%lld\\n", best[n - 1] == LLONG_MAX ? -1 : best[n - 1]);
    }
    return 0;
}"""


def judge_prompt(prose: str, code: str, question: str) -> str:
    """Statement text, then the fenced code and the question, filled up to SIZE bytes."""
    tail = f"\nMy solution:\n```cpp\n{code}\n```\n{question}"
    budget = SIZE - len(tail.encode())
    statement = ""
    while len((statement + prose).encode()) <= budget:
        statement += prose
    # Top up with the start of one more paragraph, cut on a character boundary.
    rest = (prose.encode()[: budget - len(statement.encode())]).decode("utf-8", "ignore")
    return statement + rest + tail


EN_4KB = judge_prompt(EN_PROSE, CODE, "What is wrong with the update of best[j]?")
ZH_4KB = judge_prompt(ZH_PROSE, CODE, "请帮我看看 best[j] 的更新哪里写错了？")
SHORT = "Does this compile? int main(){return 0;}"
SHORT_ZH_VOCABULARY = "用线段树维护区间最大值，懒标记应该怎么下传？"
EN_PROSE_4KB = (EN_PROSE * 10).encode()[:SIZE].decode()
UNFENCED_CODE_4KB = (
    "\n".join([CODE] * (SIZE // len(CODE) + 1)).encode()[: SIZE - 30].decode()
    + "\nwhy does this print -1?"
)

CLASSIFIER = ComplexityClassifier()


def body(text: str) -> dict[str, Any]:
    return {
        "model": "judge",
        "messages": [
            {"role": "system", "content": "You are the judge's assistant."},
            {"role": "user", "content": text},
        ],
    }


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(EN_4KB, ("simple", "default"), id="en-4kb"),
        pytest.param(ZH_4KB, ("simple", "default"), id="zh-4kb"),
        pytest.param(SHORT, ("simple", "keyword=does this compile"), id="short"),
        pytest.param(
            SHORT_ZH_VOCABULARY, ("complex", "algorithm=线段树"), id="short-zh-vocabulary"
        ),
        pytest.param(EN_PROSE_4KB, ("simple", "default"), id="worst-en-prose-4kb"),
        pytest.param(UNFENCED_CODE_4KB, ("complex", "code_lines=135"), id="worst-unfenced-4kb"),
    ],
)
def test_classify(benchmark: Any, text: str, expected: tuple[str, str]) -> None:
    assert len(text.encode()) <= SIZE
    request = body(text)
    # The case measures the path it names: check the decision before timing it.
    assert CLASSIFIER.classify(request) == expected
    benchmark(CLASSIFIER.classify, request)


@pytest.mark.parametrize(
    "text", [pytest.param(EN_4KB, id="en-4kb"), pytest.param(ZH_4KB, id="zh-4kb")]
)
def test_reference_json_decode(benchmark: Any, text: str) -> None:
    raw = orjson.dumps(body(text))
    benchmark(orjson.loads, raw)
