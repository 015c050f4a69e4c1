//! Incremental decoder for `text/event-stream` bodies: bytes in, the `data` of each event out.
//! Only what OpenAI-style servers use: `data:` lines (joined with '\n' when an event has several),
//! blank-line event boundaries, LF or CRLF line ends. `event:`, `id:`, `retry:` and comments are
//! skipped. Not a general SSE client (no reconnects, no last-event-id).

#[derive(Default)]
pub struct SseDecoder {
    /// Bytes after the last complete line; a network chunk may end mid-line or mid-UTF-8 character.
    pending: Vec<u8>,
    /// `data` lines of the event being read, not yet ended by a blank line.
    data: Vec<String>,
}

impl SseDecoder {
    /// Feeds one network chunk; returns the data of every event it completed, in order.
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<String> {
        self.pending.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some(nl) = self.pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.pending.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&line[..nl]);
            self.line(line.strip_suffix('\r').unwrap_or(&line), &mut events);
        }
        events
    }

    /// Ends the stream: a last event not followed by a blank line still counts.
    pub fn finish(mut self) -> Vec<String> {
        let mut events = Vec::new();
        if !self.pending.is_empty() {
            let rest = std::mem::take(&mut self.pending);
            let line = String::from_utf8_lossy(&rest);
            self.line(line.strip_suffix('\r').unwrap_or(&line), &mut events);
        }
        self.line("", &mut events);
        events
    }

    fn line(&mut self, line: &str, events: &mut Vec<String>) {
        if line.is_empty() {
            if !self.data.is_empty() {
                events.push(self.data.join("\n"));
                self.data.clear();
            }
        } else if let Some(d) = line.strip_prefix("data:") {
            self.data.push(d.strip_prefix(' ').unwrap_or(d).to_string());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_across_chunks_come_out_whole() {
        let mut d = SseDecoder::default();
        assert!(d.feed(b"data: {\"a\"").is_empty());
        assert_eq!(d.feed(b":1}\n\ndata: [DO"), vec!["{\"a\":1}"]);
        assert_eq!(d.feed(b"NE]\n\n"), vec!["[DONE]"]);
        assert!(d.finish().is_empty());
    }

    #[test]
    fn crlf_comments_and_other_fields_are_handled() {
        let mut d = SseDecoder::default();
        let got = d.feed(b": keep-alive\r\n\r\nevent: message\r\nid: 3\r\ndata:x\r\ndata: y\r\n\r\n");
        assert_eq!(got, vec!["x\ny"]);
    }

    #[test]
    fn last_event_without_blank_line_counts_at_finish() {
        let mut d = SseDecoder::default();
        assert!(d.feed(b"data: tail").is_empty());
        assert_eq!(d.finish(), vec!["tail"]);
    }

    #[test]
    fn multibyte_character_split_between_chunks_survives() {
        let mut d = SseDecoder::default();
        let s = "data: é\n\n".as_bytes();
        let (a, b) = s.split_at(7); // inside the two-byte 'é'
        assert!(d.feed(a).is_empty());
        assert_eq!(d.feed(b), vec!["é"]);
    }
}
