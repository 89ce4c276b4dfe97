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
5. `long_prompt=<chars>` → complex: the user text is longer than `long_prompt_chars` characters.
6. `code_lines=<lines>` → complex: the user text holds at least `code_lines_complex` lines of
   code: the lines inside ``` fences, plus lines outside fences that look like code (counted
   only when the prose outside fences contains a typical code word such as `include`, `int`,
   `def`, `return` or `printf`; plain prose is not scanned line by line).
7. `default` → the configured `routing.default_complexity`.

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
* Long prompt comes before code size only because it is free to check; both answer complex.
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
  is not split into words, so substring is the only sensible unit.
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

Cost: everything is compiled in `__init__`. `classify` encodes the text once, maps it to
lower-case words with one `bytes.translate`, and intersects its words with the keyword words in
C (`frozenset.intersection`); only keywords whose longest word occurs are then confirmed by
their own regex. The substring keywords of both lists are one regex alternation, run only when
the text is not pure ASCII (or some substring keyword is ASCII). Code lines outside fences are
counted only when the prose holds a code word and the keyword and length rules did not decide.
See benches/test_classifier_bench.py for numbers.
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
    "SCAN_CHARS",
    "ComplexityClassifier",
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
        "_complex",
        "_simple",
        "_substrings",
        "_trigger_list",
        "_trigger_search",
        "_triggers",
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
        # Every word that announces a word keyword of either list: one C-level intersection
        # with the text's words then tells which keywords are worth confirming.
        self._triggers: frozenset[bytes] = (
            self._complex.triggers | self._simple.triggers | {_BIG_O_WORD} | _CODE_WORDS
        )
        # Whole-word search for every trigger in one Aho-Corasick pass in the core (in the
        # word form every word stands between spaces).
        self._trigger_list = sorted(self._triggers)
        self._trigger_search = KeywordSet(self._trigger_list)
        # The substring keywords of both lists, found in one pass over the text.
        self._substrings = _SubstringScanner([*self._complex.substrings, *self._simple.substrings])

    @classmethod
    def from_config(cls, config: Config) -> ComplexityClassifier:
        """The classifier of `routing.classifier` and `routing.default_complexity`."""
        return cls(config.routing.classifier, config.routing.default_complexity)

    def classify(self, body: Mapping[str, Any]) -> tuple[str, str]:
        """`(complexity, rule)` for a chat or completions request body (module docstring)."""
        parts = _user_texts(body)
        if not parts:
            return self.default_complexity, "no_text"
        text = _Text(parts)
        names = self._trigger_list
        hits = frozenset(names[i] for i in self._trigger_search.present(text.word_form()))
        found = self._substrings.occurrences(text)
        keyword = self._complex.first(text, hits, found)
        if keyword is not None:
            return "complex", f"keyword={keyword}"
        bound = text.big_o() if _BIG_O_WORD in hits else None
        if bound is not None:
            return "complex", f"big_o={bound}"
        keyword = self._simple.first(text, hits, found)
        if keyword is not None:
            return "simple", f"keyword={keyword}"
        if text.chars > self.long_prompt_chars:
            return "complex", f"long_prompt={text.chars}"
        lines = text.fenced_lines
        if not hits.isdisjoint(_CODE_WORDS):
            lines += text.unfenced_code_lines()
        if lines >= self.code_lines_complex:
            return "complex", f"code_lines={lines}"
        return self.default_complexity, "default"


class _Text:
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

    def words(self) -> list[bytes]:
        return self.word_form().split()

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
        "_by_trigger",
        "_names",
        "_spellings",
        "_substring_index",
        "_word_res",
        "triggers",
    )

    def __init__(self, keywords: Iterable[str]) -> None:
        # Keyword i is named `_names[i]`; a word keyword has its regex in `_word_res[i]`, a
        # substring keyword its normalised lower-case text in `_substring_index`.
        self._names: list[str] = []
        self._word_res: dict[int, re.Pattern[bytes]] = {}
        self._by_trigger: dict[bytes, list[int]] = {}
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
                    self._add_word_keyword(index, words)
            else:
                self._substring_index.setdefault(_fold(name), index)
        self.triggers: frozenset[bytes] = frozenset(self._by_trigger)

    def _add_word_keyword(self, index: int, words: tuple[str, ...]) -> None:
        forms = sorted(_inflections(words[-1]), key=len, reverse=True)
        # In the word form every word is preceded and followed by at least one space.
        pattern = b" " + b"".join(re.escape(w.encode()) + b" +" for w in words[:-1])
        pattern += b"(?:" + b"|".join(re.escape(f.encode()) for f in forms) + b")(?= )"
        self._word_res[index] = re.compile(pattern)
        # A keyword is announced by its longest word, the rarest in prose: "complexity", not
        # "time"; "compile", not "does" (every English prompt would then pay for a regex
        # scan). The last word is announced by any of its forms.
        at = max(range(len(words)), key=lambda i: (len(words[i]), i))
        for trigger in forms if at == len(words) - 1 else [words[at]]:
            self._by_trigger.setdefault(trigger.encode(), []).append(index)

    @property
    def substrings(self) -> list[str]:
        """This set's substring keywords, folded (see `_fold`)."""
        return list(self._substring_index)

    def first(
        self, text: _Text, hits: frozenset[bytes], substrings: list[tuple[int, str]]
    ) -> str | None:
        """The keyword of this set that occurs first outside code in `text`, if any.

        `hits` are the announcing words found in the text, `substrings` the substring keyword
        occurrences of both lists. The first occurrence of each candidate is looked up, then
        lines are checked for code in text order, so usually a single line is checked.
        """
        # (position, -length, index, end): at one position the longer keyword wins.
        pending: list[tuple[int, int, int, int]] = []
        candidates = {i for word in hits for i in self._by_trigger.get(word, ())}
        form = text.word_form() if candidates else b""
        for index in candidates:
            found = self._word_res[index].search(form)
            if found is not None:
                # The match starts at the space before the keyword.
                pending.append((found.start() + 1, -len(self._names[index]), index, found.end()))
        own = [
            (pos, i)
            for pos, folded in substrings
            if (i := self._substring_index.get(folded)) is not None
        ]
        pending.extend((pos, -len(self._names[i]), i, -1) for pos, i in own)
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

    def occurrences(self, text: _Text) -> list[tuple[int, str]]:
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
