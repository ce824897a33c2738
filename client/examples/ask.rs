//! Ask one question and stream the answer (async API).
//! `cargo run --example ask -- "What is the capital of France?"`

use mlxbc_client::{Client, ClientError, GenerateRequest, Response, Settings};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), ClientError> {
    let question = std::env::args().nth(1).unwrap_or_else(|| "What is the capital of France?".into());
    let mut client = Client::connect_or_start(&Settings::from_env()?).await?;
    let mut stream = client.generate(GenerateRequest::ask(question)).await?;
    while let Some(event) = stream.next_event().await? {
        match event {
            Response::Token { text } => print!("{text}"),
            Response::Done { stats } => {
                println!("\n[{} tokens, {:.1} tok/s]", stats.generated_tokens, stats.decode_tokens_per_s)
            }
            _ => {}
        }
    }
    Ok(())
}
