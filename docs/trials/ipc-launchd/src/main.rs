//! Trial of `interprocess` (local sockets: peer credentials, an inherited
//! listening fd) and `launchd` (the LaunchAgent plist with a Sockets key).
use interprocess::local_socket::{
    tokio::{prelude::*, Listener, Stream},
    GenericFilePath, ListenerOptions, ToFsName,
};
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::main]
async fn main() {
    let dir = std::env::temp_dir().join(format!("ipc-trial-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // 1. A listener by path, peer credentials on accept.
    let path = dir.join("a.sock");
    let name = path.clone().to_fs_name::<GenericFilePath>().unwrap();
    let listener = ListenerOptions::new().name(name.clone()).create_tokio().unwrap();
    let client = tokio::spawn(async move {
        let mut s = Stream::connect(name).await.unwrap();
        s.write_all(b"hi").await.unwrap();
    });
    let mut conn = listener.accept().await.unwrap();
    match conn.peer_creds() {
        Ok(c) => println!("peer_creds: uid {:?} pid {:?} gid {:?}", c.euid(), c.pid(), c.egid()),
        Err(e) => println!("peer_creds failed: {e}"),
    }
    let mut buf = [0u8; 2];
    conn.read_exact(&mut buf).await.unwrap();
    client.await.unwrap();
    println!("read {:?}", std::str::from_utf8(&buf).unwrap());

    // 2. An inherited listening descriptor (what systemd/launchd hand over).
    let path2 = dir.join("b.sock");
    let std_listener = std::os::unix::net::UnixListener::bind(&path2).unwrap();
    std_listener.set_nonblocking(true).unwrap();
    let fd = unsafe { OwnedFd::from_raw_fd(std_listener.into_raw_fd()) };
    match interprocess::os::unix::uds_local_socket::tokio::Listener::try_from(fd) {
        Ok(l) => {
            let l = Listener::from(l);
            let p2 = path2.clone();
            let c = tokio::spawn(async move {
                let _s = tokio::net::UnixStream::connect(p2).await.unwrap();
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            });
            let s = l.accept().await.unwrap();
            println!("inherited fd: accepted; peer uid {:?}", s.peer_creds().ok().and_then(|c| c.euid()));
            c.await.unwrap();
        }
        Err(e) => println!("inherited fd refused: {e:?}"),
    }

    // 3. The LaunchAgent plist with the Sockets key through the launchd
    // crate: with SockPathMode (0600: only the owner may connect), as
    // mlxbcd's plist needs, and without it.
    use launchd::{Launchd, Socket, SocketOptions};
    for mode in [Some(0o600), None] {
        let mut opts = SocketOptions::new().with_path_name(dir.join("c.sock")).unwrap();
        if let Some(m) = mode {
            opts = opts.with_path_mode(m);
        }
        let agent = Launchd::new("io.mlxbc.mlxbcd", "/usr/local/bin/mlxbcd")
            .unwrap()
            .with_run_at_load(true)
            .with_socket(launchd::Sockets::from(Socket::new("Listeners", opts)));
        let mut out = Vec::new();
        match agent.to_writer_xml(&mut out) {
            Ok(()) => println!("launchd plist, SockPathMode {mode:?}:\n{}", String::from_utf8_lossy(&out)),
            Err(e) => println!("launchd plist, SockPathMode {mode:?}: failed: {e:?}"),
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}
