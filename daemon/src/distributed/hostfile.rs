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

    /// What MLX's NCCL backend reads for rank `r`, derived from this
    /// hostfile as `mlx.launch --backend nccl` derives it from its own:
    /// the world size (`MLX_WORLD_SIZE`), rank 0's host and port as NCCL's
    /// rendezvous (`NCCL_HOST_IP`, `NCCL_PORT`; 12345, mlx.launch's
    /// default, when rank 0's entry names no port), and the GPU the rank
    /// takes (`CUDA_VISIBLE_DEVICES`): its place among the ranks on its
    /// host, so one multi-GPU host runs one rank per GPU.
    pub fn nccl_environment(&self, r: usize) -> Vec<(&'static str, String)> {
        let port = self.ranks[0]
            .first()
            .and_then(|a| a.rsplit_once(':'))
            .and_then(|(_, p)| p.parse::<u16>().ok())
            .unwrap_or(12345);
        let local = (0..r).filter(|&other| self.host(other) == self.host(r)).count();
        vec![
            ("MLX_WORLD_SIZE", self.size().to_string()),
            ("NCCL_HOST_IP", self.host(0)),
            ("NCCL_PORT", port.to_string()),
            ("CUDA_VISIBLE_DEVICES", local.to_string()),
        ]
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
    fn nccl_ranks_on_one_host_take_one_gpu_each_and_meet_at_rank_zero() {
        let h = Hostfile::parse(r#"[["127.0.0.1:5000"], ["127.0.0.1:5001"], ["10.0.0.2:5000"], ["127.0.0.1:5002"]]"#)
            .unwrap();
        let env = |r| h.nccl_environment(r).into_iter().collect::<std::collections::BTreeMap<_, _>>();
        assert_eq!(env(0)["MLX_WORLD_SIZE"], "4");
        assert_eq!((env(1)["NCCL_HOST_IP"].as_str(), env(1)["NCCL_PORT"].as_str()), ("127.0.0.1", "5000"));
        let gpus: Vec<String> = (0..4).map(|r| env(r)["CUDA_VISIBLE_DEVICES"].clone()).collect();
        assert_eq!(gpus, ["0", "1", "0", "2"], "a rank's GPU is its place among its host's ranks");
        let bare =
            Hostfile::parse(r#"[{"ssh": "gpu1", "ips": ["10.0.0.1"]}, {"ssh": "gpu1", "ips": ["10.0.0.1"]}]"#).unwrap();
        assert_eq!(bare.nccl_environment(1)[2], ("NCCL_PORT", "12345".to_string()));
    }

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
