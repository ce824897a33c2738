// Where the binaries find libmlx at run time, and which BLAS MLX's CPU
// matmuls land in.
fn main() {
    let libdir = std::env::var("DEP_MLX_LIBDIR").expect("mlx-sys must publish libdir");
    // First ./mlx/lib next to the executable (the shipped bundle), then the
    // wheel unpacked by mlx-sys's build script (development and CI).
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("macos") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,@loader_path/mlx/lib");
    } else {
        println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN/mlx/lib");
    }
    println!("cargo:rustc-link-arg=-Wl,-rpath,{libdir}");
    // The mlx-cpu wheel ships the reference (netlib) BLAS: 3 GFLOP/s f32
    // matmul. When Debian's OpenBLAS is installed, make the executables need it
    // so its cblas_sgemm wins symbol lookup (~140 GFLOP/s on 2 cores).
    // MLXBC_BLAS=reference keeps the wheel's BLAS (for comparisons).
    println!("cargo:rerun-if-env-changed=MLXBC_BLAS");
    let want_reference = std::env::var("MLXBC_BLAS").as_deref() == Ok("reference");
    let have_openblas = ["/usr/lib/x86_64-linux-gnu/libopenblas.so.0", "/usr/lib/aarch64-linux-gnu/libopenblas.so.0"]
        .iter()
        .any(|p| std::path::Path::new(p).exists());
    if !want_reference && have_openblas && std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-link-arg=-Wl,--push-state,--no-as-needed,-l:libopenblas.so.0,--pop-state");
        println!("cargo:rustc-env=MLXBC_BLAS_IN_USE=openblas");
    } else {
        println!("cargo:rustc-env=MLXBC_BLAS_IN_USE=mlx-wheel");
    }
}
