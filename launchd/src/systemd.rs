//! systemd user units: `mlxbc.socket` listens from login (sockets.target)
//! and starts `mlxbc.service` on the first connection, passing the socket as
//! fd 3 (`LISTEN_FDS`); the service reports readiness with sd_notify
//! (`Type=notify`) and is restarted if it crashes, not after a clean idle exit.

use crate::ServiceSpec;

/// Unit file names.
pub const SOCKET_UNIT: &str = "mlxbc.socket";
pub const SERVICE_UNIT: &str = "mlxbc.service";

/// `mlxbc.socket`.
pub fn socket_unit(spec: &ServiceSpec) -> String {
    format!(
        "[Unit]\n\
         Description=mlxbc local inference daemon (socket)\n\
         \n\
         [Socket]\n\
         ListenStream={}\n\
         SocketMode=0600\n\
         DirectoryMode=0700\n\
         RemoveOnStop=yes\n\
         \n\
         [Install]\n\
         WantedBy=sockets.target\n",
        spec.socket.display()
    )
}

/// `mlxbc.service`.
pub fn service_unit(spec: &ServiceSpec) -> String {
    let env: String =
        spec.env.iter().map(|(k, v)| format!("Environment=\"{k}={}\"\n", v.replace('"', "\\\""))).collect();
    format!(
        "[Unit]\n\
         Description=mlxbc local inference daemon (mlxbcd)\n\
         Requires={SOCKET_UNIT}\n\
         After={SOCKET_UNIT}\n\
         \n\
         [Service]\n\
         Type=notify\n\
         NotifyAccess=main\n\
         ExecStart={}\n\
         {env}\
         Restart=on-failure\n\
         RestartSec=2\n\
         \n\
         [Install]\n\
         WantedBy=default.target\n",
        spec.daemon.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(daemon: &std::path::Path, socket: &std::path::Path) -> ServiceSpec {
        ServiceSpec {
            daemon: daemon.into(),
            socket: socket.into(),
            log_file: "/unused".into(),
            env: vec![("MLXBC_HOME".into(), "/home/a/.local/share/mlxbc".into()), ("MLXBC_LOG".into(), "info".into())],
        }
    }

    #[test]
    fn units_name_the_socket_the_binary_and_the_environment() {
        let s = spec("/usr/local/bin/mlxbcd".as_ref(), "/run/user/1000/mlxbc/mlxbcd.sock".as_ref());
        let socket = socket_unit(&s);
        assert!(socket.contains("\nListenStream=/run/user/1000/mlxbc/mlxbcd.sock\n"), "{socket}");
        assert!(socket.contains("\nSocketMode=0600\n"));
        let service = service_unit(&s);
        assert!(service.contains("\nExecStart=/usr/local/bin/mlxbcd\n"), "{service}");
        assert!(service.contains("\nType=notify\n"));
        assert!(service.contains("\nEnvironment=\"MLXBC_HOME=/home/a/.local/share/mlxbc\"\n"));
    }

    /// systemd's own checker on the rendered units (systemd-analyze comes
    /// with Debian's systemd package; scripts/install-deps installs it).
    #[test]
    fn systemd_analyze_verify_accepts_both_units() {
        let dir = tempfile::tempdir().unwrap();
        let daemon = dir.path().join("mlxbcd");
        std::fs::write(&daemon, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&daemon, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let s = spec(&daemon, &dir.path().join("mlxbcd.sock"));
        let (sock, svc) = (dir.path().join(SOCKET_UNIT), dir.path().join(SERVICE_UNIT));
        std::fs::write(&sock, socket_unit(&s)).unwrap();
        std::fs::write(&svc, service_unit(&s)).unwrap();
        let out = std::process::Command::new("systemd-analyze")
            .args(["verify", "--man=no"])
            .arg(&sock)
            .arg(&svc)
            .output()
            .expect("systemd-analyze is missing: apt-get install systemd (scripts/install-deps does)");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "systemd-analyze verify failed:\n{stderr}");
        // verify exits 0 on some warnings; none may name our units.
        let ours: Vec<&str> = stderr.lines().filter(|l| l.contains("mlxbc.")).collect();
        assert!(ours.is_empty(), "systemd-analyze warnings about the units:\n{}", ours.join("\n"));
    }
}
