//! `mlxbc chat`: an interactive conversation with line editing and history
//! (rustyline). Without `--session` the conversation lives here and is sent
//! whole each turn; with `--session NAME` the daemon keeps it (across
//! restarts) and each turn sends only the new message, so a shell or editor
//! can continue it later. Piped stdin: one turn per line.
//!
//! In the prompt: `/image PATH` attaches an image to the next message,
//! `/reset` forgets the conversation, `/exit` (or Ctrl-D) leaves.

use crate::ChatArgs;
use anyhow::Result;
use mlxbc_client::{ChatMessage, Client, GenerateRequest, MediaRef, Response, SamplingParams, SessionCommand};
use std::io::{IsTerminal, Write};

pub async fn run(client: &mut Client, args: &ChatArgs, history_file: &std::path::Path) -> Result<()> {
    let interactive = std::io::stdin().is_terminal();
    let mut editor = rustyline::DefaultEditor::new()?;
    if interactive {
        let _ = editor.load_history(history_file);
        if let Some(name) = &args.session {
            let past = client.sessions(SessionCommand::Show { name: name.clone() }).await?;
            let n = past.first().map_or(0, |s| s.messages.len());
            eprintln!("session {name}: {n} earlier messages (kept by the daemon). /exit to leave, /reset to forget.");
        }
    }
    let mut conversation: Vec<ChatMessage> = Vec::new();
    let mut images: Vec<MediaRef> = Vec::new();
    let mut system_sent = false;
    let mut lines = std::io::stdin().lines();
    loop {
        let line = if interactive {
            match editor.readline(">>> ") {
                Ok(l) => {
                    let _ = editor.add_history_entry(l.as_str());
                    l
                }
                Err(rustyline::error::ReadlineError::Interrupted) => continue,
                Err(rustyline::error::ReadlineError::Eof) => break,
                Err(e) => return Err(e.into()),
            }
        } else {
            match lines.next() {
                Some(l) => l?,
                None => break,
            }
        };
        let line = line.trim();
        match line.split_once(' ').map_or((line, ""), |(c, rest)| (c, rest.trim())) {
            ("", _) => continue,
            ("/exit" | "/quit", _) => break,
            ("/reset", _) => {
                conversation.clear();
                system_sent = false;
                if let Some(name) = &args.session {
                    client.sessions(SessionCommand::Delete { name: name.clone() }).await?;
                }
                eprintln!("(conversation forgotten)");
                continue;
            }
            ("/image", path) => {
                images.extend(crate::ask::read_media(&[path.into()])?);
                eprintln!("(image attached to the next message)");
                continue;
            }
            _ => {}
        }
        let mut user = ChatMessage::user(line);
        user.images = std::mem::take(&mut images);
        let mut turn = Vec::new();
        if let (Some(system), false) = (&args.system, system_sent) {
            // Sent with this run's first turn (and so stored in a session's history).
            turn.push(ChatMessage::system(system.clone()));
            system_sent = true;
        }
        turn.push(user);
        let messages = if args.session.is_some() {
            turn.clone()
        } else {
            let mut all = conversation.clone();
            all.extend(turn.iter().cloned());
            all
        };
        let request = GenerateRequest {
            model: args.model.clone(),
            messages,
            sampling: SamplingParams { temperature: args.temperature, ..Default::default() },
            max_tokens: args.max_tokens,
            stop: vec![],
            keep_alive: None,
            ignore_eos: false,
            session: args.session.clone(),
            constraint: None,
            tools: vec![],
            tool_choice: Default::default(),
            raw: None,
            logprobs: None,
        };
        let mut stream = client.generate(request).await?;
        let mut answer = String::new();
        let mut out = std::io::stdout().lock();
        while let Some(event) = stream.next_event().await? {
            match event {
                Response::Token { text } => {
                    out.write_all(text.as_bytes())?;
                    out.flush()?;
                    answer.push_str(&text);
                }
                Response::Done { stats } => {
                    // The conversation goes on; the user must know this turn was not kept.
                    for w in &stats.warnings {
                        eprintln!("\nmlxbc: warning: {w}");
                    }
                }
                _ => {}
            }
        }
        writeln!(out)?;
        conversation.extend(turn);
        conversation.push(ChatMessage::assistant(answer));
    }
    if interactive {
        let _ = editor.save_history(history_file);
    }
    Ok(())
}
