//! Progress for long operations (model load, prefetch, the wait for a first
//! token while a model loads): a spinner with elapsed time on a terminal,
//! nothing at all when stderr is piped.

use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::time::Duration;

/// A running spinner; cleared when dropped.
pub struct Spinner(Option<ProgressBar>);

impl Spinner {
    /// Starts one on a terminal; a no-op otherwise.
    pub fn start(message: impl Into<String>) -> Self {
        if !std::io::stderr().is_terminal() {
            return Spinner(None);
        }
        let bar = ProgressBar::new_spinner();
        bar.set_style(ProgressStyle::with_template("{spinner} {msg} {elapsed}").expect("valid template"));
        bar.set_message(message.into());
        bar.enable_steady_tick(Duration::from_millis(100));
        Spinner(Some(bar))
    }

    /// Stops and clears it now.
    pub fn stop(&mut self) {
        if let Some(bar) = self.0.take() {
            bar.finish_and_clear();
        }
    }
}

impl Drop for Spinner {
    fn drop(&mut self) {
        self.stop();
    }
}
