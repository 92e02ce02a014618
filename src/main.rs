fn main() {
    // Library backtraces stay off unless asked for by name: candle captures one into every error when
    // RUST_BACKTRACE is set and prints it as part of the error's message (often formatted into another
    // message before it reaches the error chain), and errors here are one line. Panics keep theirs.
    if std::env::var_os("RUST_LIB_BACKTRACE").is_none() {
        std::env::set_var("RUST_LIB_BACKTRACE", "0");
    }
    std::process::exit(probespec::cli::main());
}
