//! A conversation that keeps its history, with the blocking API: each line
//! of stdin is a user turn; the whole history goes with every turn.
//! `printf 'My name is Ada.\nWhat is my name?\n' | cargo run --example chat`

use mlxbc_client::blocking::Client;
use mlxbc_client::{ChatMessage, ClientError, GenerateRequest, Settings};
use std::io::{BufRead, Write};

fn main() -> Result<(), ClientError> {
    let mut client = Client::connect_or_start(&Settings::from_env()?)?;
    let mut history = vec![ChatMessage::system("You are a helpful assistant. Answer briefly.")];
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| ClientError::Unexpected(e.to_string()))?;
        history.push(ChatMessage::user(line));
        let mut request = GenerateRequest::ask("");
        request.messages = history.clone();
        request.max_tokens = 64;
        let mut answer = String::new();
        client.generate(request, |piece| {
            print!("{piece}");
            let _ = std::io::stdout().flush();
            answer.push_str(piece);
        })?;
        println!();
        history.push(ChatMessage::assistant(answer));
    }
    Ok(())
}
