"""The `auto` complexity classifier (SPEC §4): explainable rules, microseconds per request.

`ComplexityClassifier(rules, default_complexity).classify(body)` returns `(complexity, rule)`,
e.g. `("complex", "keyword=时间复杂度")`; `header_value(complexity, rule)` renders it for the
`X-Gateway-Complexity` response header. The classifier reads only what the client asked: the
`content` of `user` messages (strings and the `text` of content parts) of a chat body, or the
`prompt` (a string or a list of strings) of a completions body. System and developer messages
are left out on purpose: they are usually one fixed instruction per application ("you are a
judge ..."), and a word in them would send every request of that application the same way.

Rules, first match wins:

1. `no_text` — no user text at all (say, only images): the configured default.
2. `keyword=<kw>` → complex: a configured complex keyword occurs ("time complexity", "prove",
   "动态规划").
3. `big_o=<notation>` → complex: asymptotic notation occurs, `O(n log n)`, `O(2^n * n)`,
   `O（n）`. Built in, not a keyword, because no keyword list can spell every bound; on a judge,
   writing a bound down is asking about complexity ("can this O(n^2) pass n = 10^6?").
4. `keyword=<kw>` → simple: a configured simple keyword occurs ("does this compile", "syntax",
   "编译").
5. `algorithm=<name>` or `question=<form>` → complex: an entry of the built-in vocabulary
   occurs, whichever comes first in the text. `ALGORITHM_NAMES` names algorithms, data
   structures, techniques and what algorithmic problems are about, in English and Chinese
   ("dijkstra", "segment tree", "union-find", "greedy", "recurrence", "subarray", "最短路",
   "二分图", "并查集", "贪心", "递推"); `QUESTION_FORMS` are ways of asking for reasoning rather
   than a fix ("derive", "counterexample", "which algorithm" via "algorithm", "correctness",
   "推导", "反例", "思路", "怎么做", "最坏"). Built in, like `big_o`, because the subject has
   hundreds of such names and a configured list would be a short sample of them; on a judge,
   naming an algorithm or asking for a proof is asking for analysis. Bare "why" and "为什么"
   are not in the list: on a judge they ask about an error message as often as about an
   algorithm ("why does printf print garbage?"). Neither are verdict names ("WA"): "what does
   WA mean?" is a definition.
6. `long_prompt=<chars>` → complex: the user text is longer than `long_prompt_chars` characters.
7. `code_lines=<lines>` → complex: the user text holds at least `code_lines_complex` lines of
   code: the lines inside ``` fences, plus lines outside fences that look like code (counted
   only when the prose outside fences contains a typical code word such as `include`, `int`,
   `def`, `return` or `printf`; plain prose is not scanned line by line).
8. `model=<score>(<features>)` → complex: a small linear model over the words and characters
   of the prose scores at least 1.0, the features that pulled most named (`MODEL_WEIGHTS`:
   52 weights; English words and word pairs, Chinese characters and character pairs). It only
   ever turns what would be the default into complex, so it never sends a prompt to the
   light pool. It learned from two small labelled sets (214 prompts), so what it knows is
   partly style ("the" and "of" pull towards complex because analysis questions are longer,
   "python" and "c" away because syntax questions name the language); it is the last resort
   before the default, and the header says when it decided.
9. `default` → the configured `routing.default_complexity`.

Why this order — what an operator would expect:

* Keywords come before the size rules because they state what the client asks, while length and
  code size only guess how hard it is. "Does this compile?" above a 300-line paste is a compile
  check, and the light model answers it; "prove this is optimal" in eight words needs the strong
  model however short it is.
* Complex keywords (and `big_o`) beat simple ones because the two mistakes do not cost the
  same: a simple question sent to the strong model costs a little money and latency, while a
  complex one sent to the light model returns a wrong analysis to a student. A prompt that asks
  both ("fix the syntax error, then tell me the time complexity") needs the strong model for its
  hard half. This is also the operator's lever against false simple hits: "it compiles fine but
  gets TLE" matches the simple keyword "compile"; adding "TLE" to the complex list routes it to
  the strong model.
* The built-in vocabulary comes after the configured keywords of both lists, so the operator
  keeps both levers: a configured simple keyword wins over it ("does my Dijkstra compile?" is
  a compile check), and a configured complex keyword routes what the vocabulary misses. It
  comes before the size rules for the same reason keywords do.
* Long prompt comes before code size only because it is free to check; both answer complex.
* The model comes after every rule because it explains least: a rule names what the client
  wrote, the model a weighted guess. It can only add complex decisions, so a simple keyword,
  or the size rules, are never overruled by it.
* The default comes last, and a request never fails to classify.

Matching, chosen so that a rule in a header can be checked by eye against the prompt:

* A keyword made of ASCII words ("prove", "worst-case", "big-o") matches whole words, case-
  insensitively, with spaces and hyphens interchangeable ("worst case" = "Worst-Case"), and with
  common English endings on its last word ("prove" matches "proves", "proved", "proving",
  "proven", "provable"; "optimize" matches "optimized", "optimization"; "complexity" matches
  "complexities"). So "prove" never fires on "improve" or "approve", nor "optimize" on
  "optimal", and "compile" fires on "compiler" and "compilation". Any character outside
  `[A-Za-z0-9_]` is a word boundary, Chinese characters included: "请prove一下" matches. The
  rule names the keyword as configured, not the inflected form found; of two configured
  keywords that differ only in spaces and hyphens, the one spelled as in the text.
* Any other keyword (Chinese, or ASCII with punctuation such as "O(n^2)") matches as a
  substring, case-insensitively; whitespace inside it matches any run of whitespace. Chinese
  is not split into words, so substring is the only sensible unit. Every keyword is looked
  for on its own: one inside a longer keyword of the other list still counts.
* The built-in vocabulary matches the same way, except that some short entries take no
  endings ("trie" does not match "tried").
* Keywords and notation inside code do not count: not inside ``` fences, and not on a line
  outside fences that looks like code — competitive programmers paste
  `#pragma GCC optimize("O3")` and `// TODO optimize` into simple questions.
* When several keywords occur, the rule names the one that occurs first in the text (at one
  position the longer, then the one listed first).
* Keywords do not understand negation: "it compiles fine" still contains "compile".
* On very long prompts only the first and last `SCAN_CHARS // 2` characters are searched for
  keywords and unfenced code (a question opens or closes a prompt; the middle of a huge one is
  pasted material), which bounds the cost; `long_prompt` counts every character.

A line outside fences "looks like code" when it is indented by a tab or four spaces (a Markdown
indented code block); ends with `;`, `{` or `}`; is a preprocessor directive (`#include`), an
import (`import sys`, `from x import y`, `using namespace std`); starts a definition (`def f(`,
`class A:`, `template <`) or a declaration (`long long x =`, `int main(`); is a Python block
header (`for i in range(n):`), a C-style `if (`, a `return`, a `cout <<`, an assignment
(`a, b = f()`) or a call (`solve()`); or starts a `//` or `/*` comment. Keywords such as `if`
and `for` count only in lower case and in code-like shapes, so "for example, ..." stays prose;
a prose line that does look like code costs at most one keyword and one counted line. To ignore
a keyword only the start of its line is looked at (not "ends with `;`"), so
"Does this compile? int main(){return 0;}" keeps its keyword.

Cost: everything is compiled in `__init__`, and one Aho-Corasick automaton in the core
(`gateway._core.KeywordSet`) does the search for all lists and for the model's features.
`classify` encodes the text once, maps it to lower-case words with one `bytes.translate`, and
lets the automaton report which keyword words and model words occur as whole words; only
keywords whose longest word and other informative words all occur are then confirmed, and
located, by their own regex. Chinese keywords (every substring keyword made of caseless
non-ASCII characters) and the model's Chinese character pairs are found by the same automaton
in a second form of the text that keeps only the continuation bytes of multi-byte characters
(`_TO_CJK`), run only when the text is not pure ASCII; a hit is confirmed in the text (`in`)
and located with `bytes.find`. The remaining substring keywords (ASCII with punctuation,
mixed) are one regex alternation, run only if there are any. Code lines outside fences are
counted, and the model's score summed, only when no rule before them decided. See
benches/test_classifier_bench.py for numbers.
"""

from __future__ import annotations

import bisect
import re
import unicodedata
from collections.abc import Iterable, Mapping
from typing import Any, Final, TypeGuard
from urllib.parse import quote, unquote

from gateway._core import KeywordSet
from gateway.config import Classifier, ComplexityName, Config

__all__ = [
    "ALGORITHM_NAMES",
    "MODEL_BIAS",
    "MODEL_WEIGHTS",
    "QUESTION_FORMS",
    "SCAN_CHARS",
    "ComplexityClassifier",
    "PromptText",
    "header_value",
    "parse_header_value",
]

SCAN_CHARS: Final = 32_768
"""At most this many characters of prose are searched: the first and the last half."""

_FENCE: Final = "```"

# Maps a UTF-8 text to lower-case ASCII words separated by spaces, one byte for one byte, so a
# position in the result is the same position in the UTF-8 bytes: A-Z → a-z, [a-z0-9_] stay,
# everything else (punctuation, whitespace, every byte of a non-ASCII character) → space.
_WORD_BYTES: Final = frozenset(b"abcdefghijklmnopqrstuvwxyz0123456789_")
_TO_WORDS: Final = bytes(
    b if b in _WORD_BYTES else b + 32 if 65 <= b <= 90 else 32 for b in range(256)
)

# Maps a UTF-8 text to its "CJK form" for the core's whole-word automaton: the continuation
# bytes of multi-byte characters (0x80-0xBF) stay, everything else becomes a space, so "线段树"
# (three 3-byte characters) becomes " ab cd ef" with a space where each lead byte was. A
# keyword made of non-ASCII characters is then found as a whole "word" of the same shape,
# "ab cd ef", in one pass for all keywords. The form forgets the lead bytes, so a hit is a
# candidate and is confirmed by a search for the exact UTF-8 bytes (`bytes.find`, in C).
_TO_CJK: Final = bytes(b if 0x80 <= b <= 0xBF else 32 for b in range(256))

# A keyword made only of ASCII words separated by spaces or hyphens is matched by words.
_WORD_KEYWORD: Final = re.compile(r"[A-Za-z0-9_]+(?:[\s\-]+[A-Za-z0-9_]+)*")
_WORD_SEPARATOR: Final = re.compile(r"[\s\-]+")

# Endings accepted on the last word of a word keyword. A word ending in "e" takes the short ones
# itself and the long ones on its stem (prove → proved, proving; optimize → optimization).
_SUFFIXES: Final = ("s", "es", "ed", "ing", "er", "ers", "ation", "ations", "able", "ably")
_E_SUFFIXES: Final = ("s", "d", "r", "rs", "n")
_STEM_SUFFIXES: Final = ("ing", "ation", "ations", "able", "ably")

# Shapes of a line that looks like code (module docstring), each matched from the "\n" before
# the line. Both patterns start with a literal "\n", so `re` jumps from line to line at memchr
# speed and tries the shapes only at line starts. Inside a line only `[^\n]*+` runs over the
# text (a tight loop; a set like `[^;{}\n]` is several times slower), and "ends with ..." is a
# lookbehind at the end of the line instead of a backtracking search.
_CODE_START_SHAPES: Final = rb"""
        (?:\t|[ ]{4})[ \t]*+[^\s]
      | [ \t]*+(?:
            \#[ \t]*+(?:include|define|pragma|import|if|ifdef|ifndef|endif|undef)\b
          | import[ \t]++[\w.*]++(?:[ \t]*+,[ \t]*+[\w.*]++)*+(?:[ \t]++as[ \t]++\w++)?
            [ \t;\r]*+(?=\n)
          | from[ \t]++[\w.]++[ \t]++import\b
          | using[ \t]++namespace\b
          | package[ \t]++[\w.]++[ \t]*+;
          | def[ \t]++\w++[ \t]*+\(
          | (?:class|struct|enum)[ \t]++\w++[ \t]*+[:({<]
          | (?:fn|func)[ \t]++\w++[ \t]*+[(<]
          | template[ \t]*+<
          | (?:(?:unsigned|signed|const|static|long|short|int|char|bool|double|float|void|auto
                |string|ll)\b[ \t*&]++)++[A-Za-z_]\w*+[ \t]*+[(\[=;,]
          | (?:if|elif|else|for|while|with|try|except|finally)\b[^\n]*+
            (?:(?<=:)|(?<=:[ \t\r]))
          | (?:if|for|while|switch)[ \t]*+\(
          | return\b
          | (?:std::)?(?:cout|cin|cerr)[ \t]*+(?:<<|>>)
          | (?://|/\*)
          | [A-Za-z_][\w.]*+(?:
                # an assignment: a, b[i] = ... / x += ...
                (?:\[[^\]\n]*+\])*+(?:[ \t]*+,[ \t]*+[A-Za-z_][\w.]*+(?:\[[^\]\n]*+\])*+)*+
                [ \t]*+(?:[-+*/%&|^]|<<|>>|//)?=(?!=)
                # a call that is the whole line: solve() / print(x); / main():
              | \([^\n]*+(?:(?<=\))|(?<=\)[:;])|(?<=\)[ \t\r])|(?<=\)[:;][ \t\r]))
            )
        )"""
# A line that starts like code. Used to ignore keywords in unfenced code: only the start of a
# line decides, so "Does this compile? int main(){return 0;}" keeps its keyword.
_CODE_LINE_START: Final = re.compile(rb"\n(?:" + _CODE_START_SHAPES + rb")", re.VERBOSE)
# A line that starts like code, or ends with ";", "{" or "}" (C, C++, Java, JS, Go, Rust, C#),
# blanks after it allowed. Used to count unfenced code lines.
_CODE_LINE: Final = re.compile(
    rb"\n(?:"
    + _CODE_START_SHAPES
    + rb"""| [^\n]*+(?:(?<=[;{}])|(?<=[;{}][ \t\r])|(?<=[;{}][ \t\r][ \t\r]))
    )""",
    re.VERBOSE,
)

# Asymptotic notation: "O(" (or a full-width "O（", as Chinese input methods type it), then up
# to 40 characters of a bound, one level of parentheses allowed ("O(n log(n))"), then ")". The
# literal "O" in front lets `re` jump from capital O to capital O; the character before it is
# checked in Python (a lookbehind first would make `re` try every position). "O(∩_∩)O" is not
# a bound: only letters, digits, spaces and arithmetic may appear inside.
_BOUND_CHAR: Final = r"[A-Za-z0-9 ^*+\-/.,!·√²³]"
_BIG_O: Final = re.compile(
    rf"O[(（](?=[^)）\n]{{0,40}}?[A-Za-z0-9])"
    rf"(?:{_BOUND_CHAR}|[(（]{_BOUND_CHAR}{{1,20}}[)）]){{1,40}}?[)）]"
)
_BIG_O_WORD: Final = b"o"  # what "O(n)" leaves in the word form: announces a possible bound

# Words that (nearly) only code contains. Prose without any of them has no unfenced code, and
# the line-by-line count (about half a microsecond per line) is skipped. Words that problem
# statements use too ("input", "print") are left out. Asking costs nothing: the words come out
# of the same set intersection as the keywords.
_CODE_WORDS: Final = frozenset(
    b"""include define pragma namespace std cin cout endl printf scanf nullptr int void const
    vector struct template typedef def elif import return sys stdin println fn func""".split()
)


def _entries(block: str) -> tuple[str, ...]:
    """The comma-separated entries of a vocabulary block; lines starting with "#" are notes."""
    lines = (line for line in block.splitlines() if not line.lstrip().startswith("#"))
    return tuple(e for e in (" ".join(x.split()) for x in ",".join(lines).split(",")) if e)


# The built-in vocabulary (module docstring, rule 5), matched like configured keywords: ASCII
# entries by words (spaces and hyphens interchangeable; common endings on the last word unless
# it is in `_NO_ENDINGS`), Chinese ones as substrings. Every entry is pure ASCII words or pure
# Chinese, so none of them needs a regex pass over the text: the core's automaton finds the
# ASCII ones in the word form and the Chinese ones in the CJK form (`_TO_CJK`). Written from
# the subject (the usual names of algorithms, data structures and techniques of an algorithms
# course or a judge's problem tags), then checked against the project's labelled prompts
# (tests/data/judge_prompts.jsonl and judge_prompts_dev.jsonl), which added the few "what
# problems are about" words and 怎么做 and removed "WA" / "wrong answer". The held-out set
# (judge_prompts_heldout.jsonl) was not used to choose entries.
ALGORITHM_NAMES: Final[tuple[str, ...]] = _entries(
    """
    # shortest paths, spanning trees, flows, matchings, connectivity, trees
    dijkstra, bellman-ford, spfa, floyd, floyd-warshall, shortest path, negative cycle,
    negative edge, negative weight, 0-1 bfs, minimum spanning tree, spanning tree, mst,
    kruskal, prim, boruvka, max flow, maximum flow, maxflow, min cut, minimum cut, mincut,
    min-cost flow, min cost max flow, mcmf, network flow, dinic, edmonds-karp, ford-fulkerson,
    push-relabel, augmenting path, residual graph, bipartite, maximum matching, max matching,
    perfect matching, hungarian, hopcroft-karp, stable marriage, topological sort,
    topological order, toposort, topo sort, strongly connected, scc, tarjan, kosaraju,
    articulation point, biconnected, cut vertex, euler tour, euler path, eulerian, hamiltonian,
    lca, lowest common ancestor, binary lifting, heavy-light, hld, centroid decomposition,
    tree diameter, rerooting, condensation, dag,
    # data structures
    segment tree, lazy propagation, fenwick, binary indexed tree, sparse table, rmq,
    range minimum, range maximum, range query, treap, splay, avl, red-black, balanced bst,
    balanced binary search tree, persistent, wavelet, trie, suffix array, suffix automaton,
    suffix tree, aho-corasick, kmp, knuth-morris-pratt, z-function, z algorithm, manacher,
    rolling hash, string hashing, polynomial hash, monotonic stack, monotone stack,
    monotonic queue, monotone queue, monotonic deque, sqrt decomposition, link-cut,
    cartesian tree, li chao, convex hull trick, union-find, disjoint set, dsu,
    path compression, union by rank,
    # techniques, analysis
    memoization, memoize, knapsack, bitmask, lis, longest increasing subsequence, lcs,
    longest common subsequence, edit distance, greedy, exchange argument, backtracking,
    branch and bound, pruning, divide and conquer, cdq, binary search, ternary search,
    two-pointer, sliding window, meet in the middle, matrix exponentiation,
    binary exponentiation, fast exponentiation,
    fft, ntt, fast fourier, convolution, sieve, eratosthenes, totient, modular inverse,
    chinese remainder, extended euclid, inclusion-exclusion, catalan, burnside, game theory,
    nim, sprague-grundy, grundy, minimax, alpha-beta, convex hull, closest pair, sweep line,
    line sweep, rotating calipers, computational geometry, np-hard, np-complete, np-hardness,
    reduction, amortised, potential method, master theorem, recurrence, invariant,
    prefix sum, difference array, coordinate compression, discretization, huffman,
    independent set, vertex cover, clique, travelling salesman, traveling salesman, tsp,
    randomized, quickselect, median of medians, optimal substructure, greedy choice,
    # what algorithmic problems are about
    subarray, subsequence, k-th smallest, k-th largest, kth smallest, kth largest, one pass,
    single pass, all pairs, number of ways, how many ways, offline queries,
    # 图论
    最短路, 负环, 负权, 差分约束, 最小生成树, 生成树, 网络流, 最大流, 最小割, 费用流, 二分图,
    最大匹配, 完美匹配, 匈牙利, 增广路, 拓扑排序, 拓扑序, 强连通, 缩点, 割点, 割边, 双连通,
    欧拉回路, 欧拉路, 哈密顿, 最近公共祖先, 倍增, 树链剖分, 重链剖分, 点分治, 直径, 换根,
    # 数据结构
    线段树, 懒标记, 树状数组, 稀疏表, 平衡树, 红黑树, 字典树, 后缀数组, 后缀自动机, 自动机,
    后缀树, 马拉车, 字符串哈希, 单调栈, 单调队列, 分块, 莫队, 主席树, 可持久化, 整体二分,
    并查集, 路径压缩, 按秩合并, 笛卡尔树, 李超, 斜率优化,
    # 方法、分析
    记忆化, 背包, 状压, 状态压缩, 数位, 区间动规, 最长上升子序列, 最长公共子序列, 编辑距离,
    贪心, 回溯, 剪枝, 分支限界, 分治, 二分答案, 二分查找, 双指针, 尺取, 滑动窗口, 折半搜索,
    矩阵快速幂, 快速幂, 傅里叶, 卷积, 筛法, 欧拉函数, 逆元, 中国剩余定理, 扩展欧几里得, 容斥,
    卡特兰, 博弈, 必胜, 必败, 凸包, 旋转卡壳, 扫描线, 最近点对, 计算几何, 归约, 摊还, 均摊,
    势能, 主定理, 递推, 递归式, 不变量, 前缀和, 差分数组, 离散化, 逆序对, 哈夫曼, 独立集,
    顶点覆盖, 旅行商, 最优子结构, 状态转移, 转移方程,
    # 题目在问什么
    子数组, 子序列, 一遍扫描, 一次遍历, 方案数, 多少种, 离线
    """
)
QUESTION_FORMS: Final[tuple[str, ...]] = _entries(
    """
    # a proof, a derivation, a counterexample, a judgement of correctness
    derive, derivation, counterexample, counter-example, disprove, show that, correctness,
    is it correct, is this correct, still correct, always correct, optimality,
    optimal solution, intuition, idea behind,
    # an algorithm or an approach
    algorithm, data structure, approach, how to solve, how do i solve, how would you solve,
    how can i solve, how should i solve,
    # cost
    quadratic, linear time, logarithmic, polynomial time, exponential, constant time,
    asymptotic, asymptotically, faster than, speed up,
    # past the compiler: the logic or the speed is wrong (not "wrong answer" or "WA" alone:
    # "what does WA mean?" is as common as "why WA?")
    time limit exceeded, memory limit exceeded, mle, logic error, logical error, logic bug,
    edge case,
    # 证明、推导、反例、正确性
    推导, 反例, 正确性, 是否正确, 怎么证, 如何证, 为何, 最优解, 原理, 单调性, 通项,
    # 算法、思路
    思路, 做法, 怎么做, 算法, 数据结构, 怎么求, 如何求, 求解, 建图, 建模,
    # 代价
    最坏, 线性, 卡常, 时间超限, 内存超限, 超内存,
    # 评测结果
    答案错误, 逻辑错误
    """
)
_VOCABULARY_KIND: Final = {
    **dict.fromkeys(ALGORITHM_NAMES, "algorithm"),
    **dict.fromkeys(QUESTION_FORMS, "question"),
}
# Words too common to announce a keyword of several words or to be looked for (see
# `_KeywordSet._add_word_keyword`).
_COMMON_WORDS: Final = frozenset(
    _entries(
        """
        the, and, for, you, can, how, does, did, not, are, was, this, that, what, which, why,
        with, from, has, have, its, all, any, one, two, but, who
        """
    )
)
# Entries whose last word takes no endings: "tried" and "tries" are not a trie, "priming" is
# not Prim's algorithm.
_NO_ENDINGS: Final = frozenset({"trie", "prim", "nim", "lis", "dag"})

# The linear model of rule 8: logistic regression with an L1 penalty over the presence of
# features of the prose: English words and pairs of adjacent words (as in the word form),
# Chinese characters and pairs of adjacent characters. Trained by `train_model` in
# tests/test_classify.py on tests/data/judge_prompts.jsonl and judge_prompts_dev.jsonl (never
# on judge_prompts_heldout.jsonl), which checks that these numbers are what training gives;
# rerun it and paste its output here after changing either set. Only the 52 features with a
# weight remain. A positive weight pulls towards complex.
MODEL_BIAS: Final = -0.3308303957769841
_MODEL_THRESHOLD: Final = 1.0
# An English feature: words of the word form, separated by single spaces.
_WORD_FEATURE: Final = re.compile(r"[a-z0-9_]+(?: [a-z0-9_]+)*")
MODEL_WEIGHTS: Final[dict[str, float]] = {
    "the": 0.9908459390949619,
    "最": 0.8710326621447461,
    "间": 0.7758194431545695,
    "of": 0.6917071906693142,
    "k": 0.547983892486208,
    "dp": 0.5388678512703118,
    "树": 0.49025811401666114,
    "度": 0.3633755731677521,
    "心": 0.3430922551495281,
    "o": 0.3415159599898175,
    "怎": 0.23104603091038795,
    "时": 0.18362734292619462,
    "1": 0.1633982188386551,
    "n 2": 0.1616354565672117,
    "for": 0.16086604314841715,
    "it": 0.12449706987109474,
    "证": 0.11715291245432694,
    "证明": 0.11715291245432694,
    "find the": 0.09391129352015257,
    "为": 0.08022890786175553,
    "tree": 0.05566077503564007,
    "10": 0.05199721573324432,
    "分": 0.03982408194722901,
    "的": 0.03096512355057161,
    "why": 0.016868302577962003,
    "怎么": 0.011969186956422424,
    "and": 0.011128218883792205,
    "我的": 0.003986055475648003,
    "judge": -0.02103391433663049,
    "the judge": -0.02103391433663049,
    "please": -0.03693224037263889,
    "is": -0.048238298223072254,
    "思": -0.08008111983178857,
    "long": -0.08762666205102432,
    "意": -0.08771783127024352,
    "输出": -0.09621776688869457,
    "input": -0.1138714860759971,
    "java": -0.12516120329085187,
    "what does": -0.1628300734351894,
    "output": -0.17909688374638755,
    "里": -0.1826980013322201,
    "does": -0.2158545402087478,
    "do": -0.21734604775817834,
    "输": -0.22062364866662493,
    "error": -0.23644918644388155,
    "意思": -0.346901510292971,
    "in": -0.3964578667557206,
    "what": -0.43386825152290986,
    "line": -0.4664022905806717,
    "行": -0.822241943561645,
    "python": -0.9459631560674527,
    "c": -1.4524954180728706,
}

# Characters a header value may carry as they are: printable ASCII and space, but not "%", which
# introduces an escape. `quote` keeps letters, digits and "_.-~" anyway.
_HEADER_SAFE: Final = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")


def header_value(complexity: str, rule: str) -> str:
    """`X-Gateway-Complexity` for a decision: `"<complexity>; <rule>"`, safe for HTTP.

    HTTP header values are latin-1 and must not carry control characters, while a rule may name
    a Chinese keyword. Every character outside printable ASCII, and "%" itself, is therefore
    percent-encoded as UTF-8 (RFC 3986 style): `complex; keyword=%E8%AF%81%E6%98%8E` for
    `keyword=证明`. ASCII rules, the usual case, pass unchanged. `parse_header_value` (or
    `urllib.parse.unquote`, or JavaScript's `decodeURIComponent`) reverses it exactly.
    """
    value = f"{complexity}; {rule}"
    if value.isascii() and value.isprintable() and "%" not in value:
        return value
    return quote(value, safe=_HEADER_SAFE, errors="surrogatepass")


def parse_header_value(value: str) -> tuple[str, str]:
    """The `(complexity, rule)` that `header_value` encoded."""
    complexity, _, rule = unquote(value, errors="surrogatepass").partition("; ")
    return complexity, rule


class ComplexityClassifier:
    """Decides `simple` or `complex` for a request to an `auto` alias, and names the rule.

    Built once per configuration (keywords are compiled here); `classify` is then pure, cheap
    and deterministic, so it may run on the event loop for every request. Rule order and
    matching are described in the module docstring.
    """

    __slots__ = (
        "_cjk_features",
        "_cjk_terms",
        "_complex",
        "_model_chars",
        "_model_word_set",
        "_model_words",
        "_simple",
        "_substrings",
        "_trigger_list",
        "_trigger_search",
        "_triggers",
        "_vocabulary",
        "code_lines_complex",
        "default_complexity",
        "long_prompt_chars",
    )

    def __init__(
        self, rules: Classifier | None = None, default_complexity: ComplexityName = "simple"
    ) -> None:
        rules = rules if rules is not None else Classifier()
        if default_complexity not in ("simple", "complex"):
            raise ValueError(
                f"default_complexity must be simple or complex, not {default_complexity!r}"
            )
        self.default_complexity: str = default_complexity
        self.long_prompt_chars: int = rules.long_prompt_chars
        self.code_lines_complex: int = rules.code_lines_complex
        self._complex = _KeywordSet(rules.complex_keywords)
        self._simple = _KeywordSet(rules.simple_keywords)
        # Both built-in lists in one set: the entry found first in the text names the rule.
        self._vocabulary = _KeywordSet((*ALGORITHM_NAMES, *QUESTION_FORMS), _NO_ENDINGS)
        sets = (self._complex, self._simple, self._vocabulary)
        # The model's English features (words, "word word") are found like keyword words.
        self._model_words = {
            f.encode(): w for f, w in MODEL_WEIGHTS.items() if _WORD_FEATURE.fullmatch(f)
        }
        self._model_word_set = frozenset(self._model_words)
        # Every word that announces a word keyword of any list, and the model's words.
        self._triggers: frozenset[bytes] = frozenset(
            {_BIG_O_WORD}.union(_CODE_WORDS, self._model_words, *(k.triggers for k in sets))
        )
        self._trigger_list = sorted(self._triggers)
        # Substring keywords: the caseless non-ASCII ones (Chinese) are found by the automaton
        # in the CJK form, each pattern standing for the keywords that share its shape; the
        # rest (ASCII with punctuation such as "O(n^2)", mixed, cased) by one regex pass. The
        # model's Chinese features share the CJK patterns.
        cjk: dict[bytes, tuple[list[tuple[str, bytes]], list[tuple[str, float]]]] = {}
        other: list[str] = []
        for folded in dict.fromkeys(f for k in sets for f in k.substrings):
            if _is_cjk_keyword(folded):
                encoded = folded.encode("utf-8")
                shape = encoded.translate(_TO_CJK).lstrip(b" ")
                cjk.setdefault(shape, ([], []))[0].append((folded, encoded))
            else:
                other.append(folded)
        # The model's Chinese features: pairs of characters share the CJK patterns; single
        # characters are looked up directly (`str` finds one character at memchr speed; as
        # patterns they would make the automaton report every character of the same shape).
        chars: list[tuple[str, float]] = []
        for feature, weight in MODEL_WEIGHTS.items():
            if feature.encode() in self._model_words:
                continue
            if not _is_cjk_keyword(feature):
                raise ValueError(f"model feature {feature!r} is neither words nor Chinese")
            if len(feature) == 1:
                chars.append((feature, weight))
            else:
                shape = feature.encode("utf-8").translate(_TO_CJK).lstrip(b" ")
                cjk.setdefault(shape, ([], []))[1].append((feature, weight))
        self._model_chars = tuple(chars)
        self._cjk_terms: list[list[tuple[str, bytes]]] = [terms for terms, _ in cjk.values()]
        self._cjk_features: list[list[tuple[str, float]]] = [f for _, f in cjk.values()]
        # One Aho-Corasick automaton in the core for both: the trigger words, found as whole
        # words in the word form (every word stands between spaces), and the CJK patterns,
        # found in the CJK form. The word form has no byte above 0x7F and the CJK form no
        # letter or digit, so neither kind can match in the other's form.
        self._trigger_search = KeywordSet([*self._trigger_list, *cjk])
        self._substrings = _SubstringScanner(other)

    @classmethod
    def from_config(cls, config: Config) -> ComplexityClassifier:
        """The classifier of `routing.classifier` and `routing.default_complexity`."""
        return cls(config.routing.classifier, config.routing.default_complexity)

    def classify(self, body: Mapping[str, Any]) -> tuple[str, str]:
        """`(complexity, rule)` for a chat or completions request body (module docstring)."""
        parts = _user_texts(body)
        if not parts:
            return self.default_complexity, "no_text"
        text = PromptText(parts)
        hits = self.trigger_hits(text)
        found = self._substrings.occurrences(text)
        cjk_hits = self._cjk_search(text)
        if cjk_hits:
            found += self._cjk_occurrences(text, cjk_hits)
        keyword = self._complex.first(text, hits, found)
        if keyword is not None:
            return "complex", f"keyword={keyword}"
        bound = text.big_o() if _BIG_O_WORD in hits else None
        if bound is not None:
            return "complex", f"big_o={bound}"
        keyword = self._simple.first(text, hits, found)
        if keyword is not None:
            return "simple", f"keyword={keyword}"
        entry = self._vocabulary.first(text, hits, found)
        if entry is not None:
            return "complex", f"{_VOCABULARY_KIND[entry]}={entry}"
        if text.chars > self.long_prompt_chars:
            return "complex", f"long_prompt={text.chars}"
        lines = text.fenced_lines
        if not hits.isdisjoint(_CODE_WORDS):
            lines += text.unfenced_code_lines()
        if lines >= self.code_lines_complex:
            return "complex", f"code_lines={lines}"
        score, present = self._model_score(text, hits, cjk_hits)
        if score >= _MODEL_THRESHOLD:
            # Named: the three features that pulled most towards complex.
            present.sort(key=lambda wf: (-wf[0], wf[1]))
            pulled = ",".join(feature for weight, feature in present[:3] if weight > 0)
            return "complex", f"model={score:.2f}({pulled})"
        return self.default_complexity, "default"

    # What the searches find, public for diagnostics and tests (`classify` uses the same).

    @property
    def triggers(self) -> frozenset[bytes]:
        """Every word (or the model's "word word" pair) that the word automaton looks for."""
        return self._triggers

    @property
    def substring_keywords(self) -> tuple[str, ...]:
        """The substring keywords of all lists (complex, simple, the vocabulary), folded."""
        sets = (self._complex, self._simple, self._vocabulary)
        return tuple(dict.fromkeys(f for k in sets for f in k.substrings))

    @property
    def regex_keywords(self) -> tuple[str, ...]:
        """The substring keywords left to the one regex pass (those the CJK automaton cannot
        find: ASCII with punctuation such as "O(n^2)", mixed or cased ones)."""
        return self._substrings.keywords

    def trigger_hits(self, text: PromptText) -> frozenset[bytes]:
        """The trigger words (`triggers`) that occur as whole words in the text's word form."""
        names = self._trigger_list
        return frozenset(names[i] for i in self._trigger_search.present(text.word_form()))

    def cjk_occurrences(self, text: PromptText) -> list[tuple[int, str]]:
        """(position in `text.padded`, folded keyword) of every Chinese keyword in the prose,
        as the automaton over the CJK form finds them."""
        return self._cjk_occurrences(text, self._cjk_search(text))

    def model_score(self, text: PromptText) -> float:
        """The linear model's score (a logit; rule 8 says complex from 1.0) for the text."""
        return self._model_score(text, self.trigger_hits(text), self._cjk_search(text))[0]

    def _cjk_search(self, text: PromptText) -> list[int]:
        """The automaton's hits in the CJK form (none for ASCII prose)."""
        if self._cjk_terms and not text.prose.isascii():
            return self._trigger_search.present(text.padded.translate(_TO_CJK))
        return []

    def _cjk_occurrences(self, text: PromptText, cjk_hits: list[int]) -> list[tuple[int, str]]:
        """(position in `padded`, folded keyword) of every Chinese keyword in the prose, given
        the automaton's hits in the CJK form."""
        padded, prose = text.padded, text.prose
        first = len(self._trigger_list)
        found: list[tuple[int, str]] = []
        for index in cjk_hits:
            # A hit says "characters of this shape occur"; the text confirms it (a search in
            # the str, which finds a missing character several times faster than in bytes),
            # then the bytes give the positions. (Trigger words cannot match in the CJK form,
            # which has no ASCII letters or digits.)
            for folded, encoded in self._cjk_terms[index - first] if index >= first else ():
                if folded not in prose:
                    continue
                pos = padded.find(encoded)
                while pos >= 0:
                    found.append((pos, folded))
                    pos = padded.find(encoded, pos + len(encoded))
        return found

    def _model_score(
        self, text: PromptText, hits: frozenset[bytes], cjk_hits: list[int]
    ) -> tuple[float, list[tuple[float, str]]]:
        """The model's score (a logit) and the (weight, feature) of the features present."""
        weights = self._model_words
        present = [(weights[w], w.decode()) for w in hits.intersection(self._model_word_set)]
        prose = text.prose
        if cjk_hits:
            first = len(self._trigger_list)
            for index in cjk_hits:
                for feature, weight in self._cjk_features[index - first] if index >= first else ():
                    if feature in prose:
                        present.append((weight, feature))
        if not prose.isascii():
            present.extend((w, c) for c, w in self._model_chars if c in prose)
        return MODEL_BIAS + sum([weight for weight, _ in present]), present


class PromptText:
    """The user text of one request, cut into prose and fenced code, with lazy derived forms.

    Positions are byte offsets into `padded`: the UTF-8 prose between a leading and a trailing
    "\n", so every line, the first and the last included, starts after a "\n" and ends before
    one. The word form is `padded` translated byte for byte, so a position in it is the same
    position in `padded`.
    """

    __slots__ = ("_words", "chars", "fenced_lines", "padded", "prose")

    def __init__(self, parts: list[str]) -> None:
        self.chars = 0
        self.fenced_lines = 0
        prose: list[str] = []
        for part in parts:
            self.chars += len(part)
            # Even pieces are outside fences; an unclosed fence runs to the end of its part, as
            # in CommonMark. Each part is split alone so one message's stray fence does not
            # turn the next message into code.
            pieces = part.split(_FENCE)
            if len(pieces) == 1:
                prose.append(part)
            else:
                prose.extend(pieces[0::2])
                self.fenced_lines += sum(map(_fenced_line_count, pieces[1::2]))
        text = prose[0] if len(prose) == 1 else "\n".join(prose)
        if len(text) > SCAN_CHARS:
            half = SCAN_CHARS // 2
            text = text[:half] + "\n" + text[-half:]
        self.prose = text
        # "surrogatepass": JSON may carry a lone surrogate ("\ud800"); it must not raise here.
        self.padded = b"\n" + text.encode("utf-8", "surrogatepass") + b"\n"
        self._words: bytes | None = None

    def word_form(self) -> bytes:
        """Lower-case ASCII words between separators; the "\n"s at both ends become spaces."""
        if self._words is None:
            self._words = self.padded.translate(_TO_WORDS)
        return self._words

    def in_code_line(self, pos: int) -> bool:
        """Whether byte `pos` lies on a line that starts like code."""
        return _CODE_LINE_START.match(self.padded, self.padded.rfind(b"\n", 0, pos)) is not None

    def byte_offset(self, char_pos: int) -> int:
        """The position in `padded` of character `char_pos` of `prose`."""
        if self.prose.isascii():
            return char_pos + 1
        return len(self.prose[:char_pos].encode("utf-8", "surrogatepass")) + 1

    def big_o(self) -> str | None:
        """The first asymptotic bound written outside code, as written (whitespace collapsed)."""
        for found in _BIG_O.finditer(self.prose):
            start = found.start()
            before = self.prose[start - 1] if start else " "
            if before.isascii() and (before.isalnum() or before == "_"):
                continue  # "IO(", "FOO(": a name, not a bound ("是O(n)" is one, though)
            if not self.in_code_line(self.byte_offset(start)):
                return " ".join(found.group().split())
        return None

    def unfenced_code_lines(self) -> int:
        """Lines outside fences that look like code."""
        return len(_CODE_LINE.findall(self.padded))


class _KeywordSet:
    """One keyword list (complex or simple), compiled for `first`."""

    __slots__ = (
        "_announcers",
        "_by_trigger",
        "_names",
        "_others",
        "_spellings",
        "_substring_index",
        "_word_res",
        "triggers",
    )

    def __init__(self, keywords: Iterable[str], no_endings: frozenset[str] = frozenset()) -> None:
        # Keyword i is named `_names[i]`; a word keyword has its regex in `_word_res[i]`, a
        # substring keyword its normalised lower-case text in `_substring_index`.
        self._names: list[str] = []
        self._word_res: dict[int, re.Pattern[bytes]] = {}
        self._by_trigger: dict[bytes, list[int]] = {}
        # For a keyword of several words, the forms of each word but the announcing one: all
        # must occur in the text before its regex is run.
        self._others: dict[int, tuple[frozenset[bytes], ...]] = {}
        words_seen: set[bytes] = set()
        self._substring_index: dict[str, int] = {}
        # Word keywords that differ only in spaces and hyphens ("worst case", "worst-case")
        # share one regex, kept under the first index; the rule then names the spelling the
        # text used.
        self._spellings: dict[int, list[str]] = {}
        owner: dict[tuple[str, ...], int] = {}
        for keyword in keywords:
            name = _display_name(keyword)
            if not name:
                continue  # config validation refuses these; stay total anyway
            index = len(self._names)
            self._names.append(name)
            if _WORD_KEYWORD.fullmatch(name):
                words = tuple(_WORD_SEPARATOR.split(name.lower()))
                if words in owner:
                    self._spellings.setdefault(owner[words], [self._names[owner[words]]])
                    self._spellings[owner[words]].append(name)
                else:
                    owner[words] = index
                    words_seen |= self._add_word_keyword(index, words, words[-1] not in no_endings)
            else:
                self._substring_index.setdefault(_fold(name), index)
        # Every form of every word of a word keyword: the automaton reports which occur.
        self.triggers: frozenset[bytes] = frozenset(words_seen)
        self._announcers = frozenset(self._by_trigger)

    def _add_word_keyword(
        self, index: int, words: tuple[str, ...], endings: bool
    ) -> frozenset[bytes]:
        """Compiles keyword `index`; returns the word forms the automaton must look for."""
        forms = sorted(_inflections(words[-1]) if endings else {words[-1]}, key=len, reverse=True)
        # In the word form every word is preceded and followed by at least one space.
        pattern = b" " + b"".join(re.escape(w.encode()) + b" +" for w in words[:-1])
        pattern += b"(?:" + b"|".join(re.escape(f.encode()) for f in forms) + b")(?= )"
        self._word_res[index] = re.compile(pattern)
        # The forms each word may take: itself, and for the last word its endings.
        alternatives = [frozenset([w.encode()]) for w in words[:-1]]
        alternatives.append(frozenset(f.encode() for f in forms))
        # A keyword is announced by its longest word, the rarest in prose: "complexity", not
        # "time"; "compile", not "does"; "show", not "that". Its other informative words must
        # occur as well before the regex scans the text, so "edge case" is not looked for in
        # every statement that says "test cases". Short and common words ("i", "of", "the")
        # are neither announcing nor looked for: the automaton would report them inside every
        # other word, and the regex checks them anyway.
        informative = [len(w) > 2 and w not in _COMMON_WORDS for w in words]
        at = max(range(len(words)), key=lambda i: (informative[i], len(words[i]), i))
        for trigger in alternatives[at]:
            self._by_trigger.setdefault(trigger, []).append(index)
        checked = [i for i in range(len(words)) if i != at and informative[i]]
        if checked:
            self._others[index] = tuple(alternatives[i] for i in checked)
        return frozenset().union(alternatives[at], *(alternatives[i] for i in checked))

    @property
    def substrings(self) -> list[str]:
        """This set's substring keywords, folded (see `_fold`)."""
        return list(self._substring_index)

    def first(
        self, text: PromptText, hits: frozenset[bytes], substrings: list[tuple[int, str]]
    ) -> str | None:
        """The keyword of this set that occurs first outside code in `text`, if any.

        `hits` are the announcing words found in the text, `substrings` the substring keyword
        occurrences of both lists. The first occurrence of each candidate is looked up, then
        lines are checked for code in text order, so usually a single line is checked.
        """
        # (position, -length, index, end): at one position the longer keyword wins.
        pending: list[tuple[int, int, int, int]] = []
        announced = hits.intersection(self._announcers)
        if not announced and not substrings:
            return None
        candidates: set[int] = set()
        others = self._others
        for word in announced:
            for index in self._by_trigger[word]:
                for forms in others.get(index, ()):
                    if hits.isdisjoint(forms):
                        break
                else:
                    candidates.add(index)
        form = text.word_form() if candidates else b""
        for index in candidates:
            found = self._word_res[index].search(form)
            if found is not None:
                # The match starts at the space before the keyword.
                pending.append((found.start() + 1, -len(self._names[index]), index, found.end()))
        if substrings:
            index_of = self._substring_index
            pending.extend(
                (pos, -len(self._names[i]), i, -1)
                for pos, folded in substrings
                if (i := index_of.get(folded)) is not None
            )
        if not pending:
            return None
        pending.sort()
        while pending:
            pos, rank, index, end = pending.pop(0)
            if not text.in_code_line(pos):
                if index in self._spellings:
                    return _spelling(self._spellings[index], text.padded[pos:end])
                return self._names[index]
            if end >= 0:
                # A word keyword on a code line: its next occurrence may still count.
                found = self._word_res[index].search(form, pos)
                if found is not None:
                    bisect.insort(pending, (found.start() + 1, rank, index, found.end()))
        return None


class _SubstringScanner:
    """Finds the substring keywords of both lists in one pass (module docstring)."""

    __slots__ = ("_folded", "_needs_ascii", "_pattern")

    def __init__(self, folded: list[str]) -> None:
        self._folded = sorted(set(folded), key=lambda n: (-len(n), n))
        # Longest first, so at one position the alternation reports the longer keyword. No
        # capturing groups: they would stop `re` from skipping ahead to the characters that can
        # start a keyword; a match is mapped back by its folded text instead.
        self._pattern: re.Pattern[str] | None = None
        if self._folded:
            self._pattern = re.compile(
                "|".join(_substring_pattern(n) for n in self._folded), re.IGNORECASE
            )
        # ASCII substrings ("o(n^2)") can occur in ASCII text; Chinese ones cannot, so ASCII
        # text is not scanned when every substring keyword has a non-ASCII character.
        self._needs_ascii = any(name.isascii() for name in self._folded)

    @property
    def keywords(self) -> tuple[str, ...]:
        return tuple(self._folded)

    def occurrences(self, text: PromptText) -> list[tuple[int, str]]:
        """(position in `padded`, folded keyword) of every substring keyword, in text order."""
        if self._pattern is None or not (self._needs_ascii or not text.prose.isascii()):
            return []
        return [
            (text.byte_offset(m.start()), self._keyword(m.group()))
            for m in self._pattern.finditer(text.prose)
        ]

    def _keyword(self, matched: str) -> str:
        folded = _fold(matched)
        if folded in self._folded:
            return folded
        # Case-insensitive matching knows pairs that lower() does not map onto each other
        # (a few Unicode letters); ask each keyword's own pattern.
        for name in self._folded:
            if re.fullmatch(_substring_pattern(name), matched, re.IGNORECASE):
                return name
        raise AssertionError(f"{matched!r} matched no substring keyword")  # pragma: no cover


def _user_texts(body: Mapping[str, Any]) -> list[str]:
    """The user-written strings of a chat (`messages`) or completions (`prompt`) body.

    Anything of another shape is skipped, never an error: validation is ingress's job, and a
    classifier that raised would turn an odd but valid request into a 500.
    """
    if not _is_mapping(body):
        return []
    messages = body.get("messages")
    if messages is None:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return [prompt] if prompt else []
        if isinstance(prompt, list):
            # A list of strings is a batch of prompts; lists of token ids carry no text.
            return [p for p in prompt if isinstance(p, str) and p]
        return []
    texts: list[str] = []
    if not isinstance(messages, list):
        return texts
    for message in messages:
        if not _is_mapping(message) or message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            if content:
                texts.append(content)
        elif isinstance(content, list):
            for part in content:
                # {"type": "text", "text": ...}; image, audio and file parts have no "text".
                text = part.get("text") if _is_mapping(part) else part
                if isinstance(text, str) and text:
                    texts.append(text)
    return texts


def _is_mapping(value: object) -> TypeGuard[Mapping[str, Any]]:
    # Decoded JSON is made of dicts; the ABC check behind isinstance(x, Mapping) costs more
    # than the rest of a short request's classification.
    return type(value) is dict or isinstance(value, Mapping)


def _fenced_line_count(piece: str) -> int:
    """Lines of code between two fences, the info string line ("```cpp") not counted.

    Blank lines count, so the number matches what an editor shows for the paste.
    """
    first_newline = piece.find("\n")
    if first_newline < 0:
        return 1 if piece.strip() else 0  # inline: ```x = 1```
    if first_newline == len(piece) - 1:
        return 0
    # Lines after the info string; the last one may lack its "\n" before the closing fence.
    return piece.count("\n", first_newline + 1) + (0 if piece.endswith("\n") else 1)


def _inflections(word: str) -> set[str]:
    """The forms of a keyword's last word that count as that word (module docstring)."""
    if len(word) < 3 or not word.isalpha():
        return {word}  # the "o" of "big-o", numbers: no endings
    if word.endswith("e"):
        # prove → proves, proved, proven, prover; prov → proving, provable, provably
        stem = word[:-1]
        return {word} | {word + s for s in _E_SUFFIXES} | {stem + s for s in _STEM_SUFFIXES}
    forms = {word} | {word + s for s in _SUFFIXES}
    if word.endswith("y"):
        forms.add(word[:-1] + "ies")  # complexity → complexities
    return forms


def _spelling(spellings: list[str], matched: bytes) -> str:
    """Of keywords that differ only in spaces and hyphens, the one written like `matched`."""
    used = _separators(matched.decode("ascii", "replace"))
    return next((s for s in spellings if _separators(s) == used), spellings[0])


def _separators(text: str) -> str:
    """The spaces and hyphens between the words of `text`: "worst-case" → "-"."""
    return "".join(c for c in " ".join(text.split()) if c in " -")


def _is_cjk_keyword(folded: str) -> bool:
    """Whether a substring keyword can be found in the CJK form: every character non-ASCII,
    not whitespace and without case (Chinese, full-width punctuation), so its exact UTF-8
    bytes are the only way to write it."""
    return all(
        c > "\x7f" and not c.isspace() and c.lower() == c == c.upper() == c.casefold()
        for c in folded
    )


def _substring_pattern(folded: str) -> str:
    return r"\s+".join(re.escape(piece) for piece in folded.split(" "))


def _fold(text: str) -> str:
    """A substring keyword or match as compared: lower case, whitespace runs as one space."""
    return " ".join(text.lower().split())


def _display_name(keyword: str) -> str:
    """The keyword as a rule names it: whitespace runs collapsed, control characters dropped.

    A rule goes into a header and a log line, so it must not carry CR, LF or other controls.
    """
    name = " ".join(keyword.split())
    if name.isprintable():
        return name
    return "".join(c for c in name if not unicodedata.category(c).startswith("C"))
