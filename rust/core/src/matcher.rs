//! Which of a fixed set of byte patterns occur in a text — the complexity classifier's keyword
//! triggers (SPEC §4: "it runs on every request").
//!
//! Aho-Corasick (via the `aho-corasick` crate): one pass over the text finds every pattern,
//! overlapping ones included, in time linear in the text. The classifier passes its "word
//! form" (lower-case ASCII words, everything else a space) and bare words as patterns; a match
//! counts only with a space (or the text's edge) on both sides, so a hit is a whole word.
//! Patterns do not carry the spaces themselves: a leading space would defeat the search's
//! prefilter on texts that are mostly spaces (Chinese prose, in the word form). Splitting the
//! text into a set of words in Python cost about twice the rest of the classifier on 4 KB.

use aho_corasick::{AhoCorasick, AhoCorasickKind};

use crate::error::CoreError;

pub struct KeywordSet {
    ac: AhoCorasick,
    patterns: usize,
}

impl KeywordSet {
    pub fn new<P: AsRef<[u8]>>(patterns: &[P]) -> Result<Self, CoreError> {
        // A full DFA: a few dozen short patterns make a small table, and scanning is then one
        // lookup per byte whatever the text looks like.
        let ac = AhoCorasick::builder()
            .kind(Some(AhoCorasickKind::DFA))
            .build(patterns)
            .map_err(|e| CoreError::InvalidConfig(format!("keyword set: {e}")))?;
        Ok(Self {
            ac,
            patterns: patterns.len(),
        })
    }

    /// The indices of the patterns that occur in `haystack` as whole words (a space or the
    /// edge on both sides), each once, ascending.
    pub fn present(&self, haystack: &[u8]) -> Vec<usize> {
        let mut seen = vec![false; self.patterns];
        let mut left = self.patterns;
        let space_at = |i: usize| haystack.get(i).is_none_or(|&b| b == b' ');
        for m in self.ac.find_overlapping_iter(haystack) {
            let i = m.pattern().as_usize();
            let whole = (m.start() == 0 || space_at(m.start() - 1)) && space_at(m.end());
            if whole && !seen[i] {
                seen[i] = true;
                left -= 1;
                if left == 0 {
                    break;
                }
            }
        }
        seen.iter()
            .enumerate()
            .filter_map(|(i, &s)| s.then_some(i))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_words_overlapping_and_once() {
        let set = KeywordSet::new(&["dp", "tle", "prove", "proving"]).unwrap();
        assert_eq!(set.present(b"my dp tle dp"), vec![0, 1]);
        // "improve" is not "prove", "dpi" is not "dp"
        assert_eq!(set.present(b" improve dpi "), Vec::<usize>::new());
        assert_eq!(set.present(b" proving that "), vec![3]);
    }
}
