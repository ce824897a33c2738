//! The macOS LaunchAgent: started at login (RunAtLoad), restarted after a
//! crash (KeepAlive.SuccessfulExit = false: a clean idle exit stays down until
//! the next connection), socket-activated through the `Sockets` key — the
//! daemon takes the socket with `launch_activate_socket("Listeners")`.

use crate::{ServiceSpec, LABEL};
use plist::{Dictionary, Value};

/// The plist as XML.
pub fn render(spec: &ServiceSpec) -> String {
    let mut out = Vec::new();
    plist::to_writer_xml(&mut out, &value(spec)).expect("a plist in memory always serializes");
    String::from_utf8(out).expect("plist XML is UTF-8")
}

/// The plist as a value (what [`render`] writes).
pub fn value(spec: &ServiceSpec) -> Value {
    let path = |p: &std::path::Path| Value::String(p.display().to_string());
    let mut listener = Dictionary::new();
    listener.insert("SockPathName".into(), path(&spec.socket));
    listener.insert("SockPathMode".into(), Value::Integer(0o600.into())); // plist integers are decimal: 384
    listener.insert("SockFamily".into(), Value::String("Unix".into()));
    let mut sockets = Dictionary::new();
    sockets.insert("Listeners".into(), Value::Dictionary(listener));
    let mut keep_alive = Dictionary::new();
    keep_alive.insert("SuccessfulExit".into(), Value::Boolean(false));
    let mut env = Dictionary::new();
    for (k, v) in &spec.env {
        env.insert(k.clone(), Value::String(v.clone()));
    }
    let mut d = Dictionary::new();
    d.insert("Label".into(), Value::String(LABEL.into()));
    // --log-file: the daemon rotates the file launchd opens for it.
    let args = vec![path(&spec.daemon), Value::String("--log-file".into()), path(&spec.log_file)];
    d.insert("ProgramArguments".into(), Value::Array(args));
    d.insert("RunAtLoad".into(), Value::Boolean(true));
    d.insert("KeepAlive".into(), Value::Dictionary(keep_alive));
    d.insert("Sockets".into(), Value::Dictionary(sockets));
    d.insert("EnvironmentVariables".into(), Value::Dictionary(env));
    d.insert("StandardOutPath".into(), path(&spec.log_file));
    d.insert("StandardErrorPath".into(), path(&spec.log_file));
    // Interactive: requests are user-facing; Background would throttle CPU and I/O.
    d.insert("ProcessType".into(), Value::String("Interactive".into()));
    Value::Dictionary(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ServiceSpec {
        ServiceSpec {
            daemon: "/opt/mlxbc/bin/mlxbcd".into(),
            socket: "/Users/a/Library/Caches/mlxbc/mlxbcd.sock".into(),
            log_file: "/Users/a/Library/Logs/mlxbc/mlxbcd.log".into(),
            env: vec![("MLXBC_LOG".into(), "info".into())],
        }
    }

    #[test]
    fn renders_a_plist_that_parses_back_with_every_key() {
        let xml = render(&spec());
        assert!(xml.starts_with("<?xml"), "{xml}");
        let v = Value::from_reader_xml(xml.as_bytes()).unwrap();
        let d = v.as_dictionary().unwrap();
        assert_eq!(d.get("Label").and_then(Value::as_string), Some(LABEL));
        assert_eq!(d.get("RunAtLoad").and_then(Value::as_boolean), Some(true));
        let args = d.get("ProgramArguments").and_then(Value::as_array).unwrap();
        assert_eq!(args[0].as_string(), Some("/opt/mlxbc/bin/mlxbcd"));
        assert_eq!(args[1].as_string(), Some("--log-file"));
        assert_eq!(args[2].as_string(), Some("/Users/a/Library/Logs/mlxbc/mlxbcd.log"));
        let ka = d.get("KeepAlive").and_then(Value::as_dictionary).unwrap();
        assert_eq!(ka.get("SuccessfulExit").and_then(Value::as_boolean), Some(false));
        let l = d.get("Sockets").and_then(Value::as_dictionary).unwrap().get("Listeners").unwrap();
        let l = l.as_dictionary().unwrap();
        assert_eq!(l.get("SockPathName").and_then(Value::as_string), Some("/Users/a/Library/Caches/mlxbc/mlxbcd.sock"));
        assert_eq!(l.get("SockPathMode").and_then(Value::as_signed_integer), Some(384));
        assert_eq!(
            d.get("StandardErrorPath").and_then(Value::as_string),
            Some("/Users/a/Library/Logs/mlxbc/mlxbcd.log")
        );
        let env = d.get("EnvironmentVariables").and_then(Value::as_dictionary).unwrap();
        assert_eq!(env.get("MLXBC_LOG").and_then(Value::as_string), Some("info"));
    }
}
