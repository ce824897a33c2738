//! `mlxbc service`: install and drive the login service. The definitions and
//! command lines come from the mlxbc-launchd crate; this file only writes,
//! removes and runs what its plan says.

use crate::ServiceCmd;
use anyhow::{bail, Context, Result};
use mlxbc_client::Settings;
use mlxbc_launchd::{Plan, Platform, ServiceSpec, Verb};
use std::io::Write;

/// The service definition for this user's settings and this `mlxbcd`.
fn spec(settings: &Settings) -> Result<ServiceSpec> {
    let daemon = mlxbc_client::daemon_program();
    let daemon = daemon.canonicalize().with_context(|| {
        format!("finding mlxbcd ({}): install it beside mlxbc or set MLXBC_DAEMON", daemon.display())
    })?;
    let mut env = vec![("MLXBC_LOG".to_string(), "info".to_string())];
    for var in ["MLXBC_HOME", "HF_HOME", "HF_ENDPOINT"] {
        if let Some(v) = std::env::var_os(var) {
            env.push((var.to_string(), v.to_string_lossy().into_owned()));
        }
    }
    Ok(ServiceSpec { daemon, socket: settings.socket.clone(), log_file: mlxbc_client::log_path(settings), env })
}

pub fn run(cmd: ServiceCmd, settings: &Settings, dry_run: bool, follow: bool) -> Result<()> {
    let verb = match cmd {
        ServiceCmd::Install => Verb::Install,
        ServiceCmd::Uninstall => Verb::Uninstall,
        ServiceCmd::Start => Verb::Start,
        ServiceCmd::Stop => Verb::Stop,
        ServiceCmd::Status => Verb::Status,
        ServiceCmd::Logs => Verb::Logs,
    };
    let home = std::env::var_os("HOME").context("HOME is not set")?;
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    let plan = Plan::new(verb, Platform::current(), &spec(settings)?, home.as_ref(), uid, follow);
    if dry_run {
        return print_plan(&plan);
    }
    for (path, text) in &plan.write {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    if verb == Verb::Install {
        let _ = std::fs::create_dir_all(&settings.paths.log_dir);
    }
    for (i, argv) in plan.commands.iter().enumerate() {
        let status = std::process::Command::new(&argv[0])
            .args(&argv[1..])
            .status()
            .with_context(|| format!("running {}", argv.join(" ")))?;
        // Reinstalling boots out the old agent first; it is fine if there was none.
        let may_fail = verb == Verb::Install && i == 0 && argv.get(1).map(String::as_str) == Some("bootout");
        if !status.success() && !may_fail {
            bail!("`{}` failed ({status})", argv.join(" "));
        }
    }
    for path in &plan.remove {
        match std::fs::remove_file(path) {
            Ok(()) => eprintln!("removed {}", path.display()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("removing {}", path.display())),
        }
    }
    Ok(())
}

fn print_plan(plan: &Plan) -> Result<()> {
    let mut out = std::io::stdout().lock();
    for (path, text) in &plan.write {
        writeln!(out, "# write {}\n{text}", path.display())?;
    }
    for path in &plan.remove {
        writeln!(out, "# remove {}", path.display())?;
    }
    for argv in &plan.commands {
        writeln!(out, "# run\n{}", argv.join(" "))?;
    }
    Ok(())
}
