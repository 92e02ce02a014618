//! Stop strings over streamed text: the text is passed on as it comes, except a tail that could be the
//! start of a stop string, held back until the next piece decides; at the first stop string the text ends
//! just before it.

pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received and not yet passed on.
    held: String,
}

/// What one piece of text gave.
#[derive(Debug, PartialEq, Eq)]
pub struct Passed {
    /// Text that is certainly part of the answer.
    pub text: String,
    /// A stop string was found: the answer ends with `text`.
    pub stopped: bool,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher {
            stops,
            held: String::new(),
        }
    }

    /// Adds a piece of the answer's text.
    pub fn push(&mut self, piece: &str) -> Passed {
        self.held.push_str(piece);
        // The stop string that is complete first wins (the longer one where two end together): text
        // cut one character at a time would have stopped there, so the answer does not depend on how
        // the text was split into pieces.
        let first_complete = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|at| (at + s.len(), at)))
            .min();
        if let Some((_, at)) = first_complete {
            self.held.truncate(at);
            return Passed {
                text: std::mem::take(&mut self.held),
                stopped: true,
            };
        }
        // Hold back the longest tail that a stop string starts with: every later start lies inside it.
        let keep_from = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| self.stops.iter().any(|s| s.starts_with(&self.held[i..])))
            .unwrap_or(self.held.len());
        let rest = self.held.split_off(keep_from);
        Passed {
            text: std::mem::replace(&mut self.held, rest),
            stopped: false,
        }
    }

    /// The end of the answer: what is still held back was no stop string.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `pieces`, returns the text passed on and whether a stop string ended it.
    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let r = m.push(p);
            out.push_str(&r.text);
            if r.stopped {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn no_stop_strings_pass_everything_at_once() {
        let mut m = StopMatcher::new(vec![]);
        assert_eq!(m.push("abc").text, "abc");
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn a_stop_string_split_across_pieces_ends_the_text_before_it() {
        assert_eq!(
            run(&["END"], &["hello E", "N", "D world"]),
            ("hello ".into(), true)
        );
        assert_eq!(run(&["\n\n"], &["a\n", "\nb"]), ("a".into(), true));
    }

    #[test]
    fn a_false_start_is_passed_on_once_it_is_decided() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("xEN").text, "x");
        assert_eq!(m.push("o").text, "ENo");
        assert_eq!(run(&["END"], &["EN", "EN", "x"]), ("ENENx".into(), false));
    }

    #[test]
    fn the_earliest_of_several_stop_strings_wins() {
        assert_eq!(run(&["zz", "b"], &["a b zz"]), ("a ".into(), true));
        assert_eq!(run(&["bc", "abcd"], &["xab", "cd"]), ("xa".into(), true));
        // Two that end on the same character: the longer cuts more.
        assert_eq!(run(&["bc", "abc"], &["xabc"]), ("x".into(), true));
    }

    #[test]
    fn the_answer_does_not_depend_on_how_the_text_is_split() {
        let stops = ["bc", "abcd", "d e", "é!"];
        let texts = ["xxabcde", "zabd e", "abé!bc", "no stop here", "aabcabcd"];
        for text in texts {
            let chars: Vec<String> = text.chars().map(String::from).collect();
            let one_by_one: Vec<&str> = chars.iter().map(String::as_str).collect();
            let expected = run(&stops, &one_by_one);
            for cut in text.char_indices().map(|(i, _)| i) {
                let (head, tail) = text.split_at(cut);
                assert_eq!(run(&stops, &[head, tail]), expected, "{text:?} cut at {cut}");
            }
            assert_eq!(run(&stops, &[text]), expected, "{text:?} whole");
        }
    }

    #[test]
    fn multibyte_text_is_cut_on_character_boundaries() {
        assert_eq!(run(&["é!"], &["café", "!"]), ("caf".into(), true));
        assert_eq!(run(&["ü"], &["naïve"]), ("naïve".into(), false));
    }
}
