// The tests crate's binaries (mlxbc-gguf-to-mlx) link MLX like mlxbcd does.
include!("../daemon/build.rs");
