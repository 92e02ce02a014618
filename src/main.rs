fn main() {
    std::process::exit(probespec::cli::main());
}
