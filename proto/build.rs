//! Compiles the `.proto` files with protox (pure Rust: no system `protoc` needed).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "limiter/v1/limiter.proto",
        "envoy/service/ratelimit/v3/rls.proto",
        "envoy/service/rate_limit_quota/v3/rlqs.proto",
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    for dir in ["limiter", "envoy"] {
        println!("cargo:rerun-if-changed={dir}");
    }
    let fds = protox::compile(files, ["."])?;
    // The encoded descriptors, for gRPC server reflection.
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("descriptors.bin"), prost::Message::encode_to_vec(&fds))?;
    tonic_prost_build::configure().build_server(true).build_client(true).compile_fds(fds)?;
    Ok(())
}
