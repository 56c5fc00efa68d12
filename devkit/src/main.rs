//! `berth-dev`: the development commands (demo, benchmark, test bed). The
//! controller's own commands are in the `berth` binary.
#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "berth-dev",
    version,
    about = "berth's development commands: the demo, the benchmark and the local control plane"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The main job in one command: a local control plane, the controller
    /// with the fake provider, three Machines with stateful and stateless
    /// workloads, and the volume-aware drain of one of them, shown live.
    Demo(berth_devkit::demo::DemoArgs),
    /// Drain benchmark on the local control plane: controller-added latency,
    /// wall time against its floor, API cost, and peers side by side; and
    /// at scale, the controller's memory and CPU under concurrent drains.
    Bench(berth_devkit::bench::BenchArgs),
    /// Start a local control plane (etcd, kube-apiserver, kube-controller-manager,
    /// kube-scheduler, kwok) and keep it running until interrupted.
    Testbed(TestbedArgs),
}

#[derive(Debug, clap::Args)]
struct TestbedArgs {
    /// Only etcd and kube-apiserver.
    #[arg(long)]
    api_only: bool,
    /// Simulated CSI attach latency.
    #[arg(long, default_value = "500ms", value_parser = humantime::parse_duration)]
    attach_delay: Duration,
    /// Simulated CSI detach latency.
    #[arg(long, default_value = "500ms", value_parser = humantime::parse_duration)]
    detach_delay: Duration,
    /// Write an audit log of every request.
    #[arg(long)]
    audit: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    berth::cli::run_to_exit("berth-dev", async {
        match cli.command {
            Command::Testbed(args) => testbed(args).await,
            Command::Demo(args) => berth_devkit::demo::run(args).await,
            Command::Bench(args) => berth_devkit::bench::run(args).await,
        }
    })
}

async fn testbed(args: TestbedArgs) -> anyhow::Result<()> {
    use berth_devkit::testbed::{Options, TestBed};
    let opts = if args.api_only {
        Options::integration()
    } else {
        Options::end_to_end()
    }
    .attach_delay(args.attach_delay)
    .detach_delay(args.detach_delay)
    .audit(args.audit);
    let bed = TestBed::start(opts).await?;
    println!("test bed ready: {}", bed.server());
    println!("  export KUBECONFIG={}", bed.kubeconfig_path().display());
    println!("  logs: {}/logs", bed.dir().display());
    println!("Ctrl-C stops it and removes its directory.");
    tokio::signal::ctrl_c().await?;
    Ok(())
}
