//! MLX's hostfile: who the ranks are.

use anyhow::{bail, Context, Result};
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::Path;

/// The ranks of a group, as MLX's `MLX_HOSTFILE` lists them: a JSON list
/// with one entry per rank, for the ring backend a list of `"host:port"`
/// addresses that rank listens on (`[["10.0.0.1:5000"], ["10.0.0.2:5000"]]`);
/// `mlx.distributed_config` also writes objects (`{"ssh": "mac2", "ips":
/// ["10.0.0.2"]}`), read here for the hosts' names.
#[derive(Debug, Clone, PartialEq)]
pub struct Hostfile {
    /// Per rank, its addresses as written.
    pub ranks: Vec<Vec<String>>,
}

impl Hostfile {
    /// Reads and checks `path` (at most 1 MiB).
    pub fn read(path: &Path) -> Result<Self> {
        let meta = std::fs::metadata(path).with_context(|| format!("reading the hostfile {}", path.display()))?;
        if meta.len() > 1 << 20 {
            bail!("the hostfile {} is over 1 MiB", path.display());
        }
        let text = std::fs::read_to_string(path).with_context(|| format!("reading the hostfile {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("the hostfile {}", path.display()))
    }

    /// Parses MLX's JSON hostfile.
    pub fn parse(text: &str) -> Result<Self> {
        let v: serde_json::Value = serde_json::from_str(text).context("not JSON")?;
        let Some(entries) = v.as_array() else { bail!("not a JSON list of ranks") };
        let mut ranks = Vec::new();
        for (i, e) in entries.iter().enumerate() {
            let list = match e {
                serde_json::Value::Array(a) => a.clone(),
                serde_json::Value::String(_) => vec![e.clone()],
                serde_json::Value::Object(o) => match (o.get("ips"), o.get("ssh")) {
                    (Some(serde_json::Value::Array(ips)), _) if !ips.is_empty() => ips.clone(),
                    (_, Some(s)) => vec![s.clone()],
                    _ => bail!("rank {i}: an object without \"ips\" or \"ssh\""),
                },
                _ => bail!("rank {i}: neither a list of addresses nor an object"),
            };
            let addresses: Vec<String> = list.iter().filter_map(|a| a.as_str().map(str::to_string)).collect();
            if addresses.is_empty() {
                bail!("rank {i} has no address");
            }
            ranks.push(addresses);
        }
        if ranks.is_empty() {
            bail!("no ranks");
        }
        Ok(Self { ranks })
    }

    /// How many ranks.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// Rank `r`'s host, for messages ("rank 2 (10.0.0.3)").
    pub fn host(&self, r: usize) -> String {
        let a = self.ranks.get(r).and_then(|a| a.first()).cloned().unwrap_or_default();
        match a.rsplit_once(':') {
            Some((host, port)) if port.parse::<u16>().is_ok() => host.trim_matches(['[', ']']).to_string(),
            _ => a,
        }
    }

    /// Rank `r`'s socket addresses (for the ring backend), resolved.
    pub fn addresses(&self, r: usize) -> Vec<SocketAddr> {
        self.ranks.get(r).into_iter().flatten().filter_map(|a| a.to_socket_addrs().ok()).flatten().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_and_config_forms_parse_and_bad_ones_are_named() {
        let h = Hostfile::parse(r#"[["127.0.0.1:39101"], ["10.0.0.2:5000", "10.0.1.2:5000"]]"#).unwrap();
        assert_eq!(h.size(), 2);
        assert_eq!(h.host(1), "10.0.0.2");
        assert_eq!(h.addresses(0), vec!["127.0.0.1:39101".parse().unwrap()]);
        let h = Hostfile::parse(r#"[{"ssh": "mac1", "ips": ["10.0.0.1"]}, {"ssh": "mac2"}]"#).unwrap();
        assert_eq!((h.host(0), h.host(1)), ("10.0.0.1".to_string(), "mac2".to_string()));
        assert!(Hostfile::parse("[]").is_err());
        assert!(Hostfile::parse(r#"[[]]"#).unwrap_err().to_string().contains("rank 0 has no address"));
        assert!(Hostfile::parse("{").is_err());
    }
}
