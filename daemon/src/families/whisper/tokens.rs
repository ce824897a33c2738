//! Whisper's special tokens and the token sets decoding suppresses, found
//! by name in the checkpoint's `tokenizer.json` (the `.en` and the
//! multilingual vocabularies number them differently), computed as
//! mlx-whisper's `tokenizer.py` does.

use super::config::WhisperConfig;
use anyhow::{bail, Context, Result};
use tokenizers::Tokenizer;

/// The ids decoding needs.
#[derive(Debug, Clone)]
pub struct SpecialTokens {
    pub eot: u32,
    pub sot: u32,
    pub sot_prev: u32,
    pub sot_lm: u32,
    pub transcribe: u32,
    pub translate: u32,
    /// `<|nospeech|>` (`<|nocaptions|>` in older vocabularies).
    pub no_speech: Option<u32>,
    pub no_timestamps: u32,
    /// `<|0.00|>`; every id from here on is a timestamp (0.02 s apart).
    pub timestamp_begin: u32,
    /// Language codes and their tokens, in the vocabulary's order (empty for `.en`).
    pub languages: Vec<(String, u32)>,
    /// `encode(" ")` and EOT: suppressed as the first sampled token.
    pub blank: Vec<u32>,
    /// Symbols that are not speech, plus the task tokens: always suppressed
    /// (`suppress_tokens="-1"`).
    pub suppress: Vec<u32>,
}

fn id(tok: &Tokenizer, name: &str) -> Result<u32> {
    tok.token_to_id(name).with_context(|| format!("tokenizer.json has no {name} token: not a Whisper tokenizer"))
}

fn encode(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    Ok(tok.encode(text, false).map_err(|e| anyhow::anyhow!("{e}"))?.get_ids().to_vec())
}

impl SpecialTokens {
    /// Reads them from `tok`.
    pub fn find(tok: &Tokenizer, config: &WhisperConfig) -> Result<Self> {
        let eot = id(tok, "<|endoftext|>")?;
        let sot = id(tok, "<|startoftranscript|>")?;
        let no_timestamps = id(tok, "<|notimestamps|>")?;
        // Tokenizers that list the timestamps have `<|0.00|>`; others end at
        // `<|notimestamps|>`, the timestamps following it.
        let timestamp_begin = tok.token_to_id("<|0.00|>").unwrap_or(no_timestamps + 1);
        if timestamp_begin as i32 + 1501 > config.vocab {
            bail!("the vocabulary ({}) has no room for 1501 timestamp tokens after id {timestamp_begin}", config.vocab);
        }
        let languages = if config.is_multilingual() {
            (sot + 1..sot + 1 + config.num_languages() as u32)
                .map(|i| {
                    let t = tok.id_to_token(i).unwrap_or_default();
                    let code = t.trim_start_matches("<|").trim_end_matches("|>").to_string();
                    (code, i)
                })
                .collect()
        } else {
            vec![]
        };
        let no_speech = tok.token_to_id("<|nospeech|>").or_else(|| tok.token_to_id("<|nocaptions|>"));
        let mut s = Self {
            eot,
            sot,
            sot_prev: id(tok, "<|startofprev|>")?,
            sot_lm: id(tok, "<|startoflm|>")?,
            transcribe: id(tok, "<|transcribe|>")?,
            translate: id(tok, "<|translate|>")?,
            no_speech,
            no_timestamps,
            timestamp_begin,
            languages,
            blank: vec![],
            suppress: vec![],
        };
        s.blank = encode(tok, " ")?;
        s.blank.push(eot);
        s.suppress = s.suppressed(tok)?;
        Ok(s)
    }

    /// `non_speech_tokens` plus the task and start tokens (and no-speech,
    /// whose probability is read separately), sorted.
    fn suppressed(&self, tok: &Tokenizer) -> Result<Vec<u32>> {
        let mut symbols: Vec<String> = "\"#()*+/:;<=>@[\\]^_`{|}~「」『』".chars().map(String::from).collect();
        symbols
            .extend("<< >> <<< >>> -- --- -( -[ (' (\" (( )) ((( ))) [[ ]] {{ }} ♪♪ ♪♪♪".split(' ').map(String::from));
        let miscellaneous: Vec<String> = "♩♪♫♬♭♮♯".chars().map(String::from).collect();
        let mut set = std::collections::BTreeSet::new();
        set.insert(encode(tok, " -")?[0]);
        set.insert(encode(tok, " '")?[0]);
        for symbol in symbols.iter().chain(&miscellaneous) {
            for ids in [encode(tok, symbol)?, encode(tok, &format!(" {symbol}"))?] {
                if ids.len() == 1 || miscellaneous.contains(symbol) {
                    set.insert(ids[0]);
                }
            }
        }
        set.extend([self.transcribe, self.translate, self.sot, self.sot_prev, self.sot_lm]);
        set.extend(self.no_speech);
        Ok(set.into_iter().collect())
    }

    /// The token of a language code (`en`), for a multilingual model.
    pub fn language(&self, code: &str) -> Option<u32> {
        self.languages.iter().find(|(c, _)| c == code).map(|(_, id)| *id)
    }

    pub fn is_multilingual(&self) -> bool {
        !self.languages.is_empty()
    }
}
