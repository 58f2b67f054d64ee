//! Links the blackbox binaries with packed relative relocations (`DT_RELR`, glibc 2.36+): a
//! position-independent Rust binary carries about 19,000 of them, and the classic table
//! (24 bytes each, 465 KB for blackbox-server) is read whole by the loader at every start,
//! which left it in the idle server's memory. The packed form is a few kilobytes.

fn main() {
    println!("cargo::rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
}
