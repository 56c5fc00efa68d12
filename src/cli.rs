//! Command-line entry points. Each subcommand parses its flags here and hands
//! over to the module that does the work.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "berth",
    version,
    about = "Machine lifecycle with a volume-aware drain"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the controller: reconcile Machines and drain their Nodes.
    Run(Box<crate::wiring::process::RunArgs>),
    /// The main job in one command: a local control plane, the controller
    /// with the fake provider, three Machines with stateful and stateless
    /// workloads, and the volume-aware drain of one of them, shown live.
    Demo(crate::demo::DemoArgs),
    /// Drain benchmark on the local control plane: controller-added latency,
    /// wall time against its floor, API cost, and peers side by side; and
    /// at scale, the controller's memory and CPU under concurrent drains.
    Bench(crate::bench::BenchArgs),
    /// Print the CustomResourceDefinitions (MachineClass, Machine) as YAML.
    Crd,
    /// Print the drain that would happen now for a Machine (read-only): the
    /// pods in each group and their order, each stateful pod's volumes and
    /// where they are attached, blocking PDBs, skipped pods, critical path.
    Plan(PlanArgs),
    /// Start a local control plane (etcd, kube-apiserver, kube-controller-manager,
    /// kube-scheduler, kwok) and keep it running until interrupted.
    Testbed(TestbedArgs),
}

#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// The Machine, as `<namespace>/<name>`.
    pub machine: String,
    /// Path to a kubeconfig file (default: in-cluster, `$KUBECONFIG`, or
    /// `~/.kube/config`).
    #[arg(long, env = "BERTH_KUBECONFIG")]
    pub kubeconfig: Option<std::path::PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct TestbedArgs {
    /// Only etcd and kube-apiserver.
    #[arg(long)]
    pub api_only: bool,
    /// Simulated CSI attach latency.
    #[arg(long, default_value = "500ms", value_parser = humantime::parse_duration)]
    pub attach_delay: Duration,
    /// Simulated CSI detach latency.
    #[arg(long, default_value = "500ms", value_parser = humantime::parse_duration)]
    pub detach_delay: Duration,
    /// Write an audit log of every request.
    #[arg(long)]
    pub audit: bool,
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("berth: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async {
        match cli.command {
            Command::Crd => crate::api::crds_yaml()
                .map(|yaml| print!("{yaml}"))
                .map_err(anyhow::Error::from),
            Command::Testbed(args) => testbed(args).await,
            Command::Run(args) => crate::wiring::process::run(*args).await,
            Command::Plan(args) => plan(args).await,
            Command::Demo(args) => crate::demo::run(args).await,
            Command::Bench(args) => crate::bench::run(args).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("berth: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn testbed(args: TestbedArgs) -> anyhow::Result<()> {
    use crate::testbed::{Options, TestBed};
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

async fn plan(args: PlanArgs) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let Some((ns, name)) = args.machine.split_once('/') else {
        anyhow::bail!("expected <namespace>/<machine>, got {:?}", args.machine);
    };
    let config = match &args.kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("cannot read kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?
        }
        None => kube::Config::infer().await?,
    };
    let client = kube::Client::try_from(config)?;
    let live = crate::drain::live::plan_machine(&client, ns, name).await?;
    println!("Machine {ns}/{name}");
    print!("{}", live.plan);
    Ok(())
}
