//! `mlxbc chat`: an interactive conversation with line editing and history
//! (rustyline). Without `--session` the conversation lives here and is sent
//! whole each turn; with `--session NAME` the daemon keeps it (across
//! restarts) and each turn sends only the new message, so a shell or editor
//! can continue it later. Piped stdin: one turn per line.
//!
//! In the prompt: `/image PATH` attaches an image to the next message,
//! `/reset` forgets the conversation, `/help` lists the commands, `/exit`
//! (or Ctrl-D) leaves; any other `/word` is refused, not sent (a line that
//! starts with a space is sent as it is). A turn the daemon could not save
//! to the session is warned about at once, and the exit code is 5, as `ask`'s.

use crate::ChatArgs;
use anyhow::Result;
use mlxbc_client::{ChatMessage, Client, GenerateRequest, MediaRef, Response, SamplingParams, SessionCommand};
use std::io::{IsTerminal, Write};

/// What `/help` prints.
const HELP: &str = "commands:\n  /image PATH   attach an image to the next message\n  /reset        forget the conversation\n  \
/help         this list\n  /exit         leave (or Ctrl-D)\na line starting with a space is sent as it is, even if it starts with /";

pub async fn run(client: &mut Client, args: &ChatArgs, history_file: &std::path::Path) -> Result<()> {
    let interactive = std::io::stdin().is_terminal();
    let mut editor = rustyline::DefaultEditor::new()?;
    if interactive {
        let _ = editor.load_history(history_file);
        let model = args.model.as_deref().unwrap_or("the default model");
        match &args.session {
            Some(name) => {
                let past = client.sessions(SessionCommand::Show { name: name.clone() }).await?;
                let n = past.first().map_or(0, |s| s.messages.len());
                eprintln!("chatting with {model} in session {name}: {n} earlier messages (kept by the daemon). /help for commands, /exit to leave.");
            }
            None => eprintln!("chatting with {model}. /help for commands, /exit or Ctrl-D to leave."),
        }
    }
    let mut warnings: Vec<String> = Vec::new();
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
        let command = line.starts_with('/');
        let line = line.trim();
        match line.split_once(' ').map_or((line, ""), |(c, rest)| (c, rest.trim())) {
            ("", _) => continue,
            (_, _) if !command => {}
            ("/exit" | "/quit", _) => break,
            ("/help" | "/?", _) => {
                eprintln!("{HELP}");
                continue;
            }
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
            (other, _) => {
                eprintln!(
                    "(unknown command {other}: /help lists them; start the line with a space to send it as text)"
                );
                continue;
            }
        }
        let mut user = ChatMessage::user(line);
        user.media = std::mem::take(&mut images);
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
            speculate: Default::default(),
            draft: None,
            draft_max: None,
            adapter: None,
            kv: Default::default(),
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
                    warnings.extend(stats.warnings.iter().cloned());
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
    if warnings.is_empty() {
        Ok(())
    } else {
        // Already printed as they came; the exit code says so too (5).
        Err(crate::Warned(vec![format!("{} turn(s) had warnings (above)", warnings.len())]).into())
    }
}
