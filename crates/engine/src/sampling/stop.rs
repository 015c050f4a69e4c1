//! Stop strings for streaming: after each newly decoded piece, decide whether a stop string has
//! appeared (and where to cut so it is not returned), and otherwise how much text may be sent now,
//! holding back a tail that could still grow into a stop string. Works on the decoded text only;
//! not for stop token ids or EOS (the engine checks those on token ids) nor for detokenization.
//!
//! The caller keeps the sequence's text and how much of it it has sent; `check` is stateless.

/// A request's stop strings (empty strings are ignored: they would match everywhere).
#[derive(Clone, Debug, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    /// Byte length of the longest stop string: how far back into old text a match can reach.
    longest: usize,
}

/// What the caller should do with the text after a piece was appended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopCheck {
    /// A stop string begins at byte `end`: the final text is `text[..end]`; generation stops.
    Stopped { end: usize },
    /// No stop string yet: `text[..releasable]` may be streamed; the rest is a possible start of
    /// a stop string and is held back. Never decreases as text grows. When the sequence ends for
    /// another reason (EOS, length), the caller sends the held-back tail too.
    Running { releasable: usize },
}

impl StopStrings {
    pub fn new(stops: &[String]) -> Self {
        let stops: Vec<String> = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        let longest = stops.iter().map(String::len).max().unwrap_or(0);
        Self { stops, longest }
    }

    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// `text` is all the output text so far, ending with the newly decoded piece of `new_len`
    /// bytes. Only matches that can involve the new piece are searched for; the earliest one
    /// wins.
    pub fn check(&self, text: &str, new_len: usize) -> StopCheck {
        if self.stops.is_empty() {
            return StopCheck::Running { releasable: text.len() };
        }
        let new_start = text.len() - new_len.min(text.len());
        let mut from = new_start.saturating_sub(self.longest - 1);
        while !text.is_char_boundary(from) {
            from -= 1;
        }
        let window = &text[from..];
        if let Some(i) = self.stops.iter().filter_map(|s| window.find(s.as_str())).min() {
            return StopCheck::Stopped { end: from + i };
        }
        let hold = self.stops.iter().map(|s| partial_match_len(text, s)).max().unwrap_or(0);
        StopCheck::Running { releasable: text.len() - hold }
    }
}

/// Length of the longest proper prefix of `stop` that `text` ends with. A match starts where
/// `stop` starts, so on a character boundary.
fn partial_match_len(text: &str, stop: &str) -> usize {
    let (text, stop) = (text.as_bytes(), stop.as_bytes());
    (1..stop.len().min(text.len() + 1)).rev().find(|&l| text.ends_with(&stop[..l])).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(s: &[&str]) -> StopStrings {
        StopStrings::new(&s.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    /// Feeds `pieces` one by one as the engine would; returns what was streamed after each piece
    /// and the final text if a stop string ended generation.
    fn stream(stop: &StopStrings, pieces: &[&str]) -> (Vec<String>, Option<String>) {
        let mut text = String::new();
        let mut sent = 0;
        let mut deltas = Vec::new();
        for piece in pieces {
            text.push_str(piece);
            match stop.check(&text, piece.len()) {
                StopCheck::Running { releasable } => {
                    assert!(releasable >= sent, "released text was taken back");
                    deltas.push(text[sent..releasable].to_string());
                    sent = releasable;
                }
                StopCheck::Stopped { end } => {
                    deltas.push(text[sent..end].to_string());
                    return (deltas, Some(text[..end].to_string()));
                }
            }
        }
        (deltas, None)
    }

    #[test]
    fn without_stop_strings_everything_is_released() {
        let (deltas, stopped) = stream(&stops(&[]), &["a", "b"]);
        assert_eq!(deltas, ["a", "b"]);
        assert_eq!(stopped, None);
        assert!(stops(&["", ""]).is_empty());
    }

    #[test]
    fn a_stop_string_inside_one_piece_cuts_before_it() {
        let s = stops(&["STOP"]);
        assert_eq!(s.check("Hello STOP world", 16), StopCheck::Stopped { end: 6 });
    }

    #[test]
    fn a_stop_string_split_across_pieces_is_held_back_then_cut() {
        let (deltas, stopped) = stream(&stops(&["</s>"]), &["Hi <", "/", "s", ">", "never"]);
        assert_eq!(deltas, ["Hi ", "", "", ""]);
        assert_eq!(stopped.as_deref(), Some("Hi "));
    }

    #[test]
    fn a_false_start_is_released_once_it_cannot_match() {
        let (deltas, stopped) = stream(&stops(&["</s>"]), &["a <", "/", "b> c"]);
        assert_eq!(deltas, ["a ", "", "</b> c"]);
        assert_eq!(stopped, None);
    }

    #[test]
    fn the_earliest_of_several_stop_strings_wins() {
        let s = stops(&["world", "lo w"]);
        assert_eq!(s.check("hello world", 11), StopCheck::Stopped { end: 3 });
    }

    #[test]
    fn the_longest_possible_start_is_held_back() {
        let s = stops(&["abc", "bcd"]);
        assert_eq!(s.check("xab", 1), StopCheck::Running { releasable: 1 });
        assert_eq!(s.check("xabx", 1), StopCheck::Running { releasable: 4 });
    }

    #[test]
    fn a_match_reaching_back_into_older_text_is_found() {
        // "end" starts two pieces back.
        let (deltas, stopped) = stream(&stops(&["end"]), &["the e", "n", "d!"]);
        assert_eq!(deltas, ["the ", "", ""]);
        assert_eq!(stopped.as_deref(), Some("the "));
    }

    #[test]
    fn matches_only_in_old_text_are_not_searched_again() {
        // The caller already acted on old text; only the new piece's reach is scanned.
        let s = stops(&["ab"]);
        assert_eq!(s.check("ab xyz", 3), StopCheck::Running { releasable: 6 });
    }

    #[test]
    fn multibyte_text_is_cut_and_held_on_character_boundaries() {
        let s = stops(&["é!"]);
        assert_eq!(s.check("café", 2), StopCheck::Running { releasable: 3 });
        assert_eq!(s.check("café!", 1), StopCheck::Stopped { end: 3 });
        // The search window would start inside "本"; it backs off to a boundary.
        let s = stops(&["x語y"]);
        assert_eq!(s.check("日本語", 3), StopCheck::Running { releasable: 9 });
        let (deltas, stopped) = stream(&stops(&["語y"]), &["日本", "語", "y"]);
        assert_eq!(deltas, ["日本", "", ""]);
        assert_eq!(stopped.as_deref(), Some("日本"));
    }

    #[test]
    fn a_piece_longer_than_the_text_is_clamped() {
        assert_eq!(stops(&["zz"]).check("z", 10), StopCheck::Running { releasable: 0 });
    }
}
