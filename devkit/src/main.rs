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
    /// The whole test suite (`make test` runs it): the test binaries of a
    /// build, several at once, the longest first, each binary's output
    /// whole when it ends, and the totals.
    Suite(berth_devkit::suite::SuiteArgs),
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
    /// Also start moto's EC2 server and a stand-in for the kubelet that
    /// joins each running instance of cluster `local` as a kwok Node, to
    /// try the aws provider on one machine.
    #[arg(long)]
    moto: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    berth::cli::run_to_exit("berth-dev", async {
        match cli.command {
            Command::Testbed(args) => testbed(args).await,
            Command::Demo(args) => berth_devkit::demo::run(args).await,
            Command::Bench(args) => berth_devkit::bench::run(args).await,
            Command::Suite(args) => berth_devkit::suite::run(args).await,
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
    let _cloud = if args.moto {
        Some(moto(&bed).await?)
    } else {
        None
    };
    println!("Ctrl-C stops it and removes its directory.");
    tokio::signal::ctrl_c().await?;
    Ok(())
}

/// moto and the kubelet stand-in for `testbed --moto`; dropped, both stop.
async fn moto(
    bed: &berth_devkit::testbed::TestBed,
) -> anyhow::Result<(
    berth_devkit::moto::Moto,
    berth_devkit::moto::kubelet::MotoKubelet,
)> {
    use berth_devkit::moto::Moto;
    use berth_devkit::moto::kubelet::{KubeletOptions, MotoKubelet};
    const REGION: &str = "eu-west-1";
    const CLUSTER: &str = "local";
    let moto = Moto::start().await?;
    let ec2 = moto.client(REGION);
    let image = ec2.image_id().await?;
    let subnet = ec2
        .default_subnets()
        .await?
        .into_iter()
        .next()
        .map(|s| s.id)
        .unwrap_or_default();
    let kubelet = MotoKubelet::start_with(bed.client().await?, ec2, KubeletOptions::new(CLUSTER));
    println!("moto's EC2 server: {} (region {REGION})", moto.endpoint());
    println!("  run berth against it (moto takes any keys):");
    println!(
        "  AWS_ACCESS_KEY_ID=moto AWS_SECRET_ACCESS_KEY=moto berth run --kubeconfig {} \\\n    \
         --providers=aws --cluster-id={CLUSTER} --aws-endpoint-url={} --leader-elect=false",
        bed.kubeconfig_path().display(),
        moto.endpoint()
    );
    println!(
        "  a class: provider aws, providerSpec {{region: {REGION}, imageId: {image}, \
         instanceType: t3.micro, subnetId: {subnet}}}"
    );
    println!("  instances of cluster {CLUSTER} that run join as kwok Nodes");
    Ok((moto, kubelet))
}
