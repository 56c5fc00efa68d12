//! The README's first command (`make demo`, which runs `berth-dev demo`),
//! run as a newcomer would: the real binary, its own control plane, and a
//! drain shown live.

#[test]
fn the_demo_drains_a_machine_and_cleans_up() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_berth-dev"))
        .args([
            "demo",
            "--metrics-addr=127.0.0.1:0",
            "--attach-delay=1s",
            "--detach-delay=1s",
        ])
        .output()
        .expect("berth demo runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "exit {:?}\n{stdout}\n{stderr}",
        out.status
    );
    let lines = |reason: &str| stdout.lines().filter(|l| l.contains(reason)).count();
    // Each stateful pod's eviction has an Event of its own; the 6 stateless
    // pods share one per batch evicted together (their PodDisruptionBudget
    // lets them go a few at a time). The summary counts the pods.
    let evicted = lines(" Evicted ");
    assert!(
        (4..=9).contains(&evicted),
        "3 stateful Events + 1 to 6 for the stateless pods, not {evicted}:\n{stdout}"
    );
    assert_eq!(lines(" VolumeDetached "), 3, "{stdout}");
    assert_eq!(lines(" VolumeAttached "), 3, "{stdout}");
    assert!(stdout.contains("DeleteVmAndNode"), "{stdout}");
    assert!(stdout.contains("--- summary ---"), "{stdout}");
    assert!(
        stdout.contains(
            "evictions: 9   volumes detached: 3   volumes re-attached elsewhere: 3   warnings: 0\n"
        ),
        "a healthy demo drains without a Warning (a PDB that just gave its disruptions is not misconfigured): {stdout}"
    );
    assert!(
        stdout.contains("/metrics"),
        "says where to scrape: {stdout}"
    );
    // The rollout: three old Machines replaced one at a time, each
    // stateful pod moved once.
    assert_eq!(lines(" ScaledOldMachineSet "), 3, "{stdout}");
    assert!(
        stdout.contains("RolloutComplete: 3 Machines of template"),
        "{stdout}"
    );
    for pod in ["db-0", "db-1", "db-2"] {
        assert!(
            stdout.contains(&format!("{pod}: moved 1 time\n")),
            "{pod}: {stdout}"
        );
    }
    assert!(stdout.contains("cleaned up"), "{stdout}");
}
