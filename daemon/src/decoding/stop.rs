//! Stop strings: text is held back while it could still be the start of a
//! stop string, and generation ends before a matched one is emitted.

/// Filters streamed text against stop strings.
pub struct StopFilter {
    stops: Vec<String>,
    pending: String,
}

/// What to do with a piece of text.
#[derive(Debug, PartialEq)]
pub enum Filtered {
    /// Emit this (possibly empty) text and go on.
    Emit(String),
    /// Emit this text, then stop: the stop string (second) matched.
    Stop(String, String),
}

impl StopFilter {
    /// A filter for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> Self {
        Self { stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(), pending: String::new() }
    }

    /// Feeds generated text.
    pub fn push(&mut self, text: &str) -> Filtered {
        self.pending.push_str(text);
        if let Some((at, stop)) =
            self.stops.iter().filter_map(|s| self.pending.find(s.as_str()).map(|at| (at, s))).min_by_key(|(at, _)| *at)
        {
            let out = self.pending[..at].to_string();
            let stop = stop.clone();
            self.pending.clear();
            return Filtered::Stop(out, stop);
        }
        // Keep the longest tail that is a prefix of some stop string.
        let hold = self
            .stops
            .iter()
            .flat_map(|s| (1..s.len()).rev().filter(|&n| s.is_char_boundary(n)).map(move |n| &s[..n]))
            .filter(|p| self.pending.ends_with(p))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let cut = self.pending.len() - hold;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        Filtered::Emit(out)
    }

    /// Text still held back when generation ends for another reason.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_partial_matches_and_stops_before_the_match() {
        let mut f = StopFilter::new(&["\nUser:".to_string()]);
        assert_eq!(f.push("Hello"), Filtered::Emit("Hello".into()));
        assert_eq!(f.push(" there\nUs"), Filtered::Emit(" there".into()));
        assert_eq!(f.push("er: hi"), Filtered::Stop("".into(), "\nUser:".into()));
    }

    #[test]
    fn releases_held_text_when_it_stops_matching() {
        let mut f = StopFilter::new(&["STOP".to_string()]);
        assert_eq!(f.push("ST"), Filtered::Emit("".into()));
        assert_eq!(f.push("AR"), Filtered::Emit("STAR".into()));
        assert_eq!(f.push("S"), Filtered::Emit("".into()));
        assert_eq!(f.finish(), "S");
    }
}
