//! Owns the control plane's processes.
//!
//! All children are spawned from one dedicated thread that lives exactly as
//! long as the [`Supervisor`]. Each child is started under
//! `setpriv --pdeathsig KILL`, so the kernel kills it when that thread goes
//! away, whatever the reason: a normal drop, a panic in a test, or the whole
//! test process being killed. Dropping the supervisor kills and reaps the
//! children in reverse start order.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;

/// What to run.
#[derive(Debug, Clone)]
pub struct ProcessSpec {
    pub name: String,
    pub program: PathBuf,
    pub args: Vec<String>,
    pub log: PathBuf,
}

enum Request {
    Spawn(ProcessSpec, mpsc::Sender<std::io::Result<u32>>),
    Status(String, mpsc::Sender<Option<ExitStatus>>),
}

pub struct Supervisor {
    tx: Option<mpsc::Sender<Request>>,
    thread: Option<JoinHandle<()>>,
}

impl Supervisor {
    pub fn new() -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Request>();
        let pdeathsig = Path::new("/usr/bin/setpriv").exists();
        let thread = std::thread::Builder::new()
            .name("testbed-supervisor".into())
            .spawn(move || run(rx, pdeathsig))?;
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    /// Starts a process and returns its pid.
    pub fn spawn(&self, spec: ProcessSpec) -> std::io::Result<u32> {
        let (reply, answer) = mpsc::channel();
        self.send(Request::Spawn(spec, reply))?;
        answer.recv().map_err(|_| gone())?
    }

    /// `Some(status)` if the named process has exited.
    pub fn exited(&self, name: &str) -> Option<ExitStatus> {
        let (reply, answer) = mpsc::channel();
        self.send(Request::Status(name.to_string(), reply)).ok()?;
        answer.recv().ok().flatten()
    }

    fn send(&self, req: Request) -> std::io::Result<()> {
        self.tx
            .as_ref()
            .ok_or_else(gone)?
            .send(req)
            .map_err(|_| gone())
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        // Closing the channel ends the thread's loop; it then kills and reaps.
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn gone() -> std::io::Error {
    std::io::Error::other("the test bed supervisor thread has stopped")
}

fn run(rx: mpsc::Receiver<Request>, pdeathsig: bool) {
    let mut children: Vec<(String, Child)> = Vec::new();
    while let Ok(req) = rx.recv() {
        match req {
            Request::Spawn(spec, reply) => {
                let result = start(&spec, pdeathsig).map(|child| {
                    let pid = child.id();
                    children.push((spec.name.clone(), child));
                    pid
                });
                let _ = reply.send(result);
            }
            Request::Status(name, reply) => {
                let status = children
                    .iter_mut()
                    .find(|(n, _)| *n == name)
                    .and_then(|(_, c)| c.try_wait().ok().flatten());
                let _ = reply.send(status);
            }
        }
    }
    for (_, mut child) in children.into_iter().rev() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

fn start(spec: &ProcessSpec, pdeathsig: bool) -> std::io::Result<Child> {
    let log = File::create(&spec.log)?;
    let mut cmd = if pdeathsig {
        let mut c = Command::new("/usr/bin/setpriv");
        c.arg("--pdeathsig")
            .arg("KILL")
            .arg("--")
            .arg(&spec.program);
        c
    } else {
        Command::new(&spec.program)
    };
    cmd.args(&spec.args)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    cmd.spawn()
}
