//! Compiles the `.proto` files with protox (pure Rust: no system `protoc` needed).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["limiter/v1/limiter.proto", "envoy/service/ratelimit/v3/rls.proto"];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    for dir in ["limiter", "envoy"] {
        println!("cargo:rerun-if-changed={dir}");
    }
    let fds = protox::compile(files, ["."])?;
    tonic_prost_build::configure().build_server(true).build_client(true).compile_fds(fds)?;
    Ok(())
}
