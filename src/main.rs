#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    berth::cli::main()
}
