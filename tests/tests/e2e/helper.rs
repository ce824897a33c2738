//! The fixture: a real `mlxbcd` process on a temp socket, with a model store
//! of real weights, stopped (SIGTERM, then SIGKILL) on drop.

use mlxbc_client::{Client, GenerateRequest, GenerationStats, Response};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub use mlxbc_test_support::{fixture, workspace};

/// A built binary of this workspace (target/<profile>/NAME).
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    let p = dir.join(name);
    assert!(p.is_file(), "{} is not built — run `cargo build --release --bins` (scripts/test does)", p.display());
    p
}

pub const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// A running daemon in its own temp home.
pub struct Daemon {
    pub child: Option<Child>,
    pub home: tempfile::TempDir,
    pub socket: PathBuf,
    pub log: PathBuf,
    /// More environment for the daemon and its CLI (e.g. HOME, HF_HOME).
    pub extra_env: Vec<(String, PathBuf)>,
}

/// What goes into the daemon's model store and command line.
pub struct DaemonOptions {
    pub models: Vec<(&'static str, PathBuf)>,
    pub args: Vec<String>,
}

impl Default for DaemonOptions {
    fn default() -> Self {
        Self { models: vec![(SMOLLM2, fixture(&format!("models/{SMOLLM2}")))], args: Vec::new() }
    }
}

impl Daemon {
    /// Starts mlxbcd with the default model in its store and waits until it answers.
    pub fn start() -> Self {
        Self::start_with(DaemonOptions::default())
    }

    pub fn start_with(opts: DaemonOptions) -> Self {
        let mut d = Self::prepare(&opts);
        d.spawn(&opts.args);
        d
    }

    /// The daemon's home and model store, without starting it.
    pub fn prepare(opts: &DaemonOptions) -> Self {
        let home = tempfile::Builder::new().prefix("mlxbc-e2e").tempdir_in("/tmp").unwrap();
        let models = home.path().join("models");
        std::fs::create_dir_all(&models).unwrap();
        for (name, target) in &opts.models {
            std::os::unix::fs::symlink(target, models.join(name)).unwrap();
        }
        Daemon {
            child: None,
            socket: home.path().join("mlxbcd.sock"),
            log: home.path().join("daemon.log"),
            home,
            extra_env: vec![],
        }
    }

    /// Starts the process the way systemd does for a socket unit: the
    /// listening socket as fd 3, `LISTEN_FDS=1`, `LISTEN_PID` = the daemon's
    /// pid (set by a shell that then execs it, so the pid is the same).
    pub fn spawn_activated(
        &mut self,
        listener: &std::os::unix::net::UnixListener,
        args: &[&str],
        env: &[(&str, &Path)],
    ) {
        use std::os::unix::io::AsRawFd;
        use std::os::unix::process::CommandExt;
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).unwrap();
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c").arg(r#"LISTEN_PID=$$ LISTEN_FDS=1 exec "$0" "$@""#).arg(binary("mlxbcd")).args(args);
        self.env(&mut cmd);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let fd = listener.as_raw_fd();
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(move || if libc::dup2(fd, 3) == 3 { Ok(()) } else { Err(std::io::Error::last_os_error()) });
        }
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(log);
        self.child = Some(cmd.spawn().unwrap());
    }

    /// Waits for the process to exit by itself; None after `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(s) = self.child.as_mut().expect("running").try_wait().unwrap() {
                self.child = None;
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// Environment every process of this daemon's "user" gets.
    pub fn env(&self, cmd: &mut Command) {
        cmd.env("MLXBC_HOME", self.home.path()).env_remove("MLXBC_SOCKET").env("MLXBC_LOG", "info");
        for (k, v) in &self.extra_env {
            cmd.env(k, v);
        }
    }

    /// Starts (or restarts) the process.
    pub fn spawn(&mut self, args: &[String]) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).unwrap();
        let mut cmd = Command::new(binary("mlxbcd"));
        self.env(&mut cmd);
        cmd.args(args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(log);
        self.child = Some(cmd.spawn().unwrap());
        self.wait_ready();
    }

    /// Starts the process with its descriptor limit (soft and hard) at `nofile`.
    pub fn spawn_limited(&mut self, args: &[String], nofile: u64) {
        use std::os::unix::process::CommandExt;
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).unwrap();
        let mut cmd = Command::new(binary("mlxbcd"));
        self.env(&mut cmd);
        cmd.args(args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(log);
        // SAFETY: setrlimit is async-signal-safe.
        unsafe {
            cmd.pre_exec(move || {
                let lim = libc::rlimit { rlim_cur: nofile, rlim_max: nofile };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
        self.child = Some(cmd.spawn().unwrap());
        self.wait_ready();
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if std::os::unix::net::UnixStream::connect(&self.socket).is_ok() {
                return;
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("mlxbcd exited ({status}) before listening:\n{}", self.log_text());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("mlxbcd did not listen within 30 s:\n{}", self.log_text());
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub async fn client(&self) -> Client {
        Client::connect(&self.socket).await.unwrap()
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("running");
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(s) = child.try_wait().unwrap() {
                return s;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("mlxbcd ignored SIGTERM for 20 s:\n{}", self.log_text());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A `mlxbc` command bound to this daemon.
    pub fn cli(&self) -> Command {
        let mut cmd = Command::new(binary("mlxbc"));
        self.env(&mut cmd);
        cmd
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            for _ in 0..250 {
                if child.try_wait().ok().flatten().is_some() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A greedy request for `prompt` with at most `max_tokens` tokens.
pub fn greedy(model: Option<&str>, prompt: &str, max_tokens: u32) -> GenerateRequest {
    let mut r = GenerateRequest::ask(prompt);
    r.model = model.map(String::from);
    r.max_tokens = max_tokens;
    r
}

/// Requests all at once, request `i` sent `delays[i]` ms after the start
/// (so that they share a batch), each on its own connection; each answer
/// (a failure panics with the daemon's log).
pub async fn together(d: &Daemon, requests: &[GenerateRequest], delays: &[u64]) -> Vec<(String, GenerationStats)> {
    let tasks: Vec<_> = requests
        .iter()
        .zip(delays)
        .map(|(r, &ms)| {
            let (socket, r) = (d.socket.clone(), r.clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                ask(socket, r).await
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap().unwrap_or_else(|e| panic!("{e}\n{}", d.log_text())));
    }
    out
}

/// Runs a request to completion on a new connection.
pub async fn ask(
    socket: impl AsRef<Path>,
    request: GenerateRequest,
) -> Result<(String, GenerationStats), mlxbc_client::ClientError> {
    let mut c = Client::connect(socket.as_ref()).await?;
    let answer = c.generate(request).await?.collect_text().await;
    answer
}

/// Reads events until the first token arrives.
pub async fn until_first_token(stream: &mut mlxbc_client::GenerationStream<'_>) {
    loop {
        match stream.next_event().await.unwrap() {
            Some(Response::Token { .. }) => return,
            Some(_) => continue,
            None => panic!("stream ended before a token"),
        }
    }
}

/// A tmpfs at `at`, unmounted on drop (the fault tests' small disks; root,
/// as CI runs: a failed mount is a failure that says so).
pub struct Mount(PathBuf);

impl Mount {
    pub fn tmpfs(at: &Path, options: &str) -> Self {
        std::fs::create_dir_all(at).unwrap();
        let out = Command::new("mount").args(["-t", "tmpfs", "-o", options, "tmpfs"]).arg(at).output().unwrap();
        assert!(
            out.status.success(),
            "mounting a tmpfs at {} ({options}) failed: {} — these fault tests need root (CI runs as root)",
            at.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        Self(at.to_owned())
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}
