//! Compiles `proto/ca.proto`, `proto/workload.proto` and
//! `proto/meshca_jwt.proto` with protox (pure Rust), so building needs no
//! system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let fds = protox::compile(["ca.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // Message-sized buffers instead of tonic's 8 KiB per call (see codec.rs).
        .codec_path("crate::codec::CaCodec")
        .compile_fds(fds)?;
    // The SPIFFE Workload API has no proto package: prost writes it to `_.rs`.
    let fds = protox::compile(["workload.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    let fds = protox::compile(["meshca_jwt.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    println!("cargo:rerun-if-changed=proto/meshca_jwt.proto");
    println!("cargo:rerun-if-changed=proto/ca.proto");
    println!("cargo:rerun-if-changed=proto/workload.proto");
    Ok(())
}
