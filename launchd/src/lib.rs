//! Service definitions for mlxbcd (LaunchAgent, systemd user units).
