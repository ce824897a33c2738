//! What each `mlxbc service` verb does on each platform, as data: files to
//! write or remove and command lines to run, in order. `mlxbc` executes a
//! plan (or prints it with `--dry-run`); tests check the plans themselves.

use crate::{launch_agent, systemd, ServiceSpec, LABEL};
use std::path::{Path, PathBuf};

/// The service manager to speak to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Platform {
    /// launchd, through `launchctl` in the user's GUI domain.
    MacOs,
    /// systemd, through `systemctl --user` and `journalctl --user`.
    Linux,
}

impl Platform {
    /// The platform this binary was built for.
    pub fn current() -> Self {
        if cfg!(target_os = "macos") {
            Platform::MacOs
        } else {
            Platform::Linux
        }
    }
}

/// The verbs of `mlxbc service`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    Install,
    Uninstall,
    Start,
    Stop,
    Status,
    Logs,
}

/// Files and commands for one verb.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan {
    pub write: Vec<(PathBuf, String)>,
    pub remove: Vec<PathBuf>,
    pub commands: Vec<Vec<String>>,
}

fn argv(parts: &[&str]) -> Vec<String> {
    parts.iter().map(|s| s.to_string()).collect()
}

impl Plan {
    /// The plan for `verb`. `home` is the user's home directory, `uid` their
    /// uid (launchd's domain is `gui/<uid>`), `follow` makes `logs` keep going.
    pub fn new(verb: Verb, platform: Platform, spec: &ServiceSpec, home: &Path, uid: u32, follow: bool) -> Plan {
        match platform {
            Platform::MacOs => Self::launchd(verb, spec, home, uid, follow),
            Platform::Linux => Self::systemd(verb, spec, home, follow),
        }
    }

    /// Where the LaunchAgent plist lives.
    pub fn plist_path(home: &Path) -> PathBuf {
        home.join("Library/LaunchAgents").join(format!("{LABEL}.plist"))
    }

    /// Where the systemd user units live.
    pub fn unit_dir(home: &Path) -> PathBuf {
        home.join(".config/systemd/user")
    }

    fn launchd(verb: Verb, spec: &ServiceSpec, home: &Path, uid: u32, follow: bool) -> Plan {
        let plist = Self::plist_path(home);
        let domain = format!("gui/{uid}");
        let target = format!("{domain}/{LABEL}");
        let plist_s = plist.display().to_string();
        match verb {
            Verb::Install => Plan {
                write: vec![(plist, launch_agent::render(spec))],
                remove: vec![],
                // bootout first so that reinstalling picks up a changed plist; its failure
                // (not loaded yet) is expected and ignored by the runner.
                commands: vec![
                    argv(&["launchctl", "bootout", &target]),
                    argv(&["launchctl", "bootstrap", &domain, &plist_s]),
                ],
            },
            Verb::Uninstall => {
                Plan { write: vec![], remove: vec![plist], commands: vec![argv(&["launchctl", "bootout", &target])] }
            }
            Verb::Start => Plan { commands: vec![argv(&["launchctl", "kickstart", &target])], ..Plan::default() },
            Verb::Stop => Plan { commands: vec![argv(&["launchctl", "kill", "SIGTERM", &target])], ..Plan::default() },
            Verb::Status => Plan { commands: vec![argv(&["launchctl", "print", &target])], ..Plan::default() },
            Verb::Logs => {
                let log = spec.log_file.display().to_string();
                let tail =
                    if follow { argv(&["tail", "-n", "100", "-F", &log]) } else { argv(&["tail", "-n", "100", &log]) };
                Plan { commands: vec![tail], ..Plan::default() }
            }
        }
    }

    fn systemd(verb: Verb, spec: &ServiceSpec, home: &Path, follow: bool) -> Plan {
        let dir = Self::unit_dir(home);
        let (socket, service) = (systemd::SOCKET_UNIT, systemd::SERVICE_UNIT);
        let ctl = |args: &[&str]| {
            let mut v = argv(&["systemctl", "--user"]);
            v.extend(argv(args));
            v
        };
        match verb {
            Verb::Install => Plan {
                write: vec![
                    (dir.join(socket), systemd::socket_unit(spec)),
                    (dir.join(service), systemd::service_unit(spec)),
                ],
                remove: vec![],
                commands: vec![ctl(&["daemon-reload"]), ctl(&["enable", "--now", socket, service])],
            },
            Verb::Uninstall => Plan {
                write: vec![],
                remove: vec![dir.join(socket), dir.join(service)],
                commands: vec![ctl(&["disable", "--now", service, socket]), ctl(&["daemon-reload"])],
            },
            Verb::Start => Plan { commands: vec![ctl(&["start", service])], ..Plan::default() },
            Verb::Stop => Plan { commands: vec![ctl(&["stop", service])], ..Plan::default() },
            Verb::Status => Plan { commands: vec![ctl(&["status", "--no-pager", socket, service])], ..Plan::default() },
            Verb::Logs => {
                let mut j = argv(&["journalctl", "--user", "-u", service, "-n", "100", "--no-pager"]);
                if follow {
                    j.push("-f".into());
                }
                Plan { commands: vec![j], ..Plan::default() }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ServiceSpec {
        ServiceSpec {
            daemon: "/usr/local/bin/mlxbcd".into(),
            socket: "/run/user/501/mlxbc/mlxbcd.sock".into(),
            log_file: "/Users/a/Library/Logs/mlxbc/mlxbcd.log".into(),
            env: vec![],
        }
    }

    fn commands(verb: Verb, platform: Platform) -> Vec<String> {
        Plan::new(verb, platform, &spec(), "/Users/a".as_ref(), 501, false)
            .commands
            .iter()
            .map(|c| c.join(" "))
            .collect()
    }

    #[test]
    fn launchctl_command_lines() {
        use Platform::MacOs;
        assert_eq!(
            commands(Verb::Install, MacOs),
            [
                "launchctl bootout gui/501/dev.mlxbc.daemon",
                "launchctl bootstrap gui/501 /Users/a/Library/LaunchAgents/dev.mlxbc.daemon.plist"
            ]
        );
        assert_eq!(commands(Verb::Uninstall, MacOs), ["launchctl bootout gui/501/dev.mlxbc.daemon"]);
        assert_eq!(commands(Verb::Start, MacOs), ["launchctl kickstart gui/501/dev.mlxbc.daemon"]);
        assert_eq!(commands(Verb::Stop, MacOs), ["launchctl kill SIGTERM gui/501/dev.mlxbc.daemon"]);
        assert_eq!(commands(Verb::Status, MacOs), ["launchctl print gui/501/dev.mlxbc.daemon"]);
        assert_eq!(commands(Verb::Logs, MacOs), ["tail -n 100 /Users/a/Library/Logs/mlxbc/mlxbcd.log"]);
        let install = Plan::new(Verb::Install, MacOs, &spec(), "/Users/a".as_ref(), 501, false);
        assert_eq!(install.write[0].0, PathBuf::from("/Users/a/Library/LaunchAgents/dev.mlxbc.daemon.plist"));
        let uninstall = Plan::new(Verb::Uninstall, MacOs, &spec(), "/Users/a".as_ref(), 501, false);
        assert_eq!(uninstall.remove, [install.write[0].0.clone()]);
    }

    #[test]
    fn systemctl_command_lines() {
        use Platform::Linux;
        assert_eq!(
            commands(Verb::Install, Linux),
            ["systemctl --user daemon-reload", "systemctl --user enable --now mlxbc.socket mlxbc.service"]
        );
        assert_eq!(
            commands(Verb::Uninstall, Linux),
            ["systemctl --user disable --now mlxbc.service mlxbc.socket", "systemctl --user daemon-reload"]
        );
        assert_eq!(commands(Verb::Start, Linux), ["systemctl --user start mlxbc.service"]);
        assert_eq!(commands(Verb::Stop, Linux), ["systemctl --user stop mlxbc.service"]);
        assert_eq!(commands(Verb::Status, Linux), ["systemctl --user status --no-pager mlxbc.socket mlxbc.service"]);
        assert_eq!(commands(Verb::Logs, Linux), ["journalctl --user -u mlxbc.service -n 100 --no-pager"]);
        let install = Plan::new(Verb::Install, Linux, &spec(), "/home/a".as_ref(), 501, false);
        let written: Vec<_> = install.write.iter().map(|(p, _)| p.display().to_string()).collect();
        assert_eq!(
            written,
            ["/home/a/.config/systemd/user/mlxbc.socket", "/home/a/.config/systemd/user/mlxbc.service"]
        );
    }
}
