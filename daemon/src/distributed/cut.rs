//! Ending a collective that waits on a peer which stopped answering.
//!
//! MLX offers no cancel: a rank blocked in a collective whose peer hangs
//! (a stopped process, a host that froze, a cable pulled without a reset)
//! stays in a blocking socket read forever (docs/trials/distributed/). The
//! one way out from another thread is to shut those sockets down: the read
//! returns, the backend reports a lost connection, and the collective's
//! evaluation fails with an error the caller handles. The backend's
//! sockets are found by their addresses: TCP sockets whose local address
//! is this rank's own hostfile address (accepted from a peer) or whose
//! remote address is another rank's (connected to it).

use std::net::SocketAddr;

/// This process's TCP sockets that belong to the ring described by `own`
/// and `peers` (see [`cut_ring_sockets`]).
pub fn ring_sockets(own: &[SocketAddr], peers: &[SocketAddr]) -> Vec<i32> {
    // SAFETY: as in `cut_ring_sockets`.
    let max_fd = unsafe { libc::sysconf(libc::_SC_OPEN_MAX) }.clamp(256, 65536) as i32;
    (0..max_fd)
        .filter(|&fd| {
            let (Some(local), peer) = (address_of(fd, false), address_of(fd, true)) else { return false };
            let listening = peer.is_none();
            !listening
                && (own.iter().any(|a| same(a, &local)) || peer.is_some_and(|p| peers.iter().any(|a| same(a, &p))))
        })
        .collect()
}

/// Blocks until one of `fds` has data to read or was closed. MLX's ring
/// backend waits for a collective's data by polling its non-blocking
/// sockets in a loop (a core at 100% for as long as it waits): a worker
/// waits here instead, asleep, until rank 0's next message starts
/// arriving, and only then enters the collective that receives it.
pub fn wait_readable(fds: &[i32]) {
    let mut polls: Vec<libc::pollfd> =
        fds.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
    loop {
        // SAFETY: `polls` is a valid array of `len` pollfd structs.
        let n = unsafe { libc::poll(polls.as_mut_ptr(), polls.len() as libc::nfds_t, -1) };
        if n >= 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return;
        }
    }
}

/// Shuts down every TCP socket of this process that belongs to the ring
/// described by `own` (this rank's listening address) and `peers` (the
/// others'); returns how many. Other sockets (the gateway, clients) are
/// left alone: their addresses are not the ring's.
pub fn cut_ring_sockets(own: &[SocketAddr], peers: &[SocketAddr]) -> usize {
    let mut cut = 0;
    // SAFETY: getsockname/getpeername/shutdown on descriptor numbers; a
    // number that is not an open socket just fails with EBADF/ENOTSOCK.
    let max_fd = unsafe { libc::sysconf(libc::_SC_OPEN_MAX) }.clamp(256, 65536) as i32;
    for fd in 0..max_fd {
        let (Some(local), peer) = (address_of(fd, false), address_of(fd, true)) else { continue };
        let ours = own.iter().any(|a| same(a, &local)) || peer.is_some_and(|p| peers.iter().any(|a| same(a, &p)));
        // SAFETY: see above.
        if ours && unsafe { libc::shutdown(fd, libc::SHUT_RDWR) } == 0 {
            cut += 1;
        }
    }
    cut
}

/// The same address and port; an unspecified bind address matches any.
fn same(want: &SocketAddr, got: &SocketAddr) -> bool {
    want.port() == got.port() && (want.ip() == got.ip() || want.ip().is_unspecified())
}

fn address_of(fd: i32, peer: bool) -> Option<SocketAddr> {
    // SAFETY: `storage` is large enough for any socket address; `len` says so.
    unsafe {
        let mut storage: libc::sockaddr_storage = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        let p = &mut storage as *mut _ as *mut libc::sockaddr;
        let rc = if peer { libc::getpeername(fd, p, &mut len) } else { libc::getsockname(fd, p, &mut len) };
        if rc != 0 {
            return None;
        }
        match storage.ss_family as i32 {
            libc::AF_INET => {
                let a = &*(p as *const libc::sockaddr_in);
                let ip = std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
                Some(SocketAddr::from((ip, u16::from_be(a.sin_port))))
            }
            libc::AF_INET6 => {
                let a = &*(p as *const libc::sockaddr_in6);
                Some(SocketAddr::from((std::net::Ipv6Addr::from(a.sin6_addr.s6_addr), u16::from_be(a.sin6_port))))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// A thread blocked reading a connection to a "peer" that never
    /// writes is released by cutting the ring's sockets, and a socket of
    /// another address stays open.
    #[test]
    fn a_blocked_read_on_a_ring_socket_returns_once_cut() {
        let ring = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let other = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let peer = ring.local_addr().unwrap();
        let mut to_peer = std::net::TcpStream::connect(peer).unwrap();
        let _held = ring.accept().unwrap();
        let unrelated = std::net::TcpStream::connect(other.local_addr().unwrap()).unwrap();
        let reader = std::thread::spawn(move || {
            let mut b = [0u8; 1];
            to_peer.read(&mut b)
        });
        std::thread::sleep(std::time::Duration::from_millis(200));
        let n = cut_ring_sockets(&[], &[peer]);
        assert!(n >= 1, "the connection to the ring peer was not found");
        let read = reader.join().unwrap();
        assert!(matches!(read, Ok(0) | Err(_)), "the blocked read did not end: {read:?}");
        assert!(unrelated.peer_addr().is_ok(), "a socket of another address was cut");
        let mut probe = [0u8; 1];
        unrelated.set_nonblocking(true).unwrap();
        assert!(matches!((&unrelated).read(&mut probe), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock));
    }
}
