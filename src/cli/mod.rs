//! Command-line entry points. Each subcommand parses its flags here and hands
//! over to the module that does the work: `berth run` to
//! `crate::wiring::process`, `berth plan` to [`plan`] (which lists what it
//! needs from the cluster) and `print` (how it shows a plan).

mod destinations;
pub mod plan;
mod print;
mod surges;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "berth",
    version,
    about = "Machine lifecycle with a volume-aware drain"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Run the controller: reconcile Machines (draining their Nodes),
    /// MachineSets and MachineDeployments, and collect orphan VMs.
    Run(Box<crate::wiring::process::RunArgs>),
    /// Print the CustomResourceDefinitions (MachineClass, Machine,
    /// MachineSet, MachineDeployment) as YAML.
    Crd,
    /// Print the drain that would happen now for a Machine (read-only): the
    /// pods in each group and their order, each stateful pod's volumes and
    /// where they are attached, blocking PDBs, skipped pods, critical path.
    Plan(PlanArgs),
}

#[derive(Debug, clap::Args)]
pub(crate) struct PlanArgs {
    /// The Machine, as `<namespace>/<name>`.
    pub machine: String,
    /// Path to a kubeconfig file (default: in-cluster, `$KUBECONFIG`, or
    /// `~/.kube/config`).
    #[arg(long, env = "BERTH_KUBECONFIG")]
    pub kubeconfig: Option<std::path::PathBuf>,
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    run_to_exit("berth", async {
        match cli.command {
            Command::Crd => crate::api::crds_yaml()
                .map(|yaml| print!("{yaml}"))
                .map_err(anyhow::Error::from),
            Command::Run(args) => crate::wiring::process::run(*args).await,
            Command::Plan(args) => print_plan(args).await,
        }
    })
}

/// Runs a command's future on a multi-threaded runtime and turns its result
/// into the process's exit code, printing an error as `<program>: <error>`
/// with its causes. Shared with the development kit's `berth-dev`.
pub fn run_to_exit(
    program: &str,
    command: impl std::future::Future<Output = anyhow::Result<()>>,
) -> ExitCode {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{program}: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{program}: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn print_plan(args: PlanArgs) -> anyhow::Result<()> {
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
    let live = self::plan::plan_machine(&client, ns, name).await?;
    println!("Machine {ns}/{name}");
    print!("{}", live.notes());
    print!("{}", live.plan);
    print!("{}", live.surges());
    print!("{}", live.budgets());
    print!("{}", live.destinations());
    Ok(())
}
