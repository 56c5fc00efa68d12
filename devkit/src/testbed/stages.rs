//! The kwok Stages that stand in for the kubelet and for a CSI attacher.
//!
//! kwok only injects its built-in stages when no Stage is configured, so the
//! node and pod lifecycles are spelled out here together with the
//! VolumeAttachment ones:
//!
//! * `node-initialize` / `node-heartbeat`: a Node that kwok manages becomes
//!   Ready and stays Ready (kwok also renews its Lease), unless it is
//!   annotated [`DEAD_ANNOTATION`]:
//! * `node-dead`: then it turns NotReady (`KubeletDown`) and stays so.
//! * `pod-ready`: a pod scheduled to such a Node becomes Running and Ready.
//!   It gets no pod IP: nothing here reads one, and in a 1,000-Node run
//!   (16 pod Stage workers) kwok's IP allocation gave pods two IPs 12,000
//!   times, which the API server refuses (422) and kwok retries, keeping
//!   the bed busy long after the pods were created.
//!   A pod annotated [`NEVER_START_ANNOTATION`] never starts: it stays
//!   `Pending` on its Node (a replacement whose image never pulls). A pod
//!   annotated [`READY_AFTER_ANNOTATION`] starts at once but is not Ready:
//! * `pod-start-unready` / `pod-ready-after`: it runs, not Ready, and turns
//!   Ready after that long (a database replaying its log); a long value
//!   (`1000h`) keeps it unready.
//! * `pod-complete`: a Running pod annotated
//!   [`COMPLETE_AFTER_ANNOTATION`] turns `Succeeded` after that duration
//!   (a terminal pod for drain tests).
//! * `pod-delete`: a pod with a deletionTimestamp disappears when its grace
//!   period has run out (the deletionTimestamp), or after
//!   [`TERMINATE_AFTER_ANNOTATION`] if the pod carries it. kwok deletes it
//!   with a grace period of 0, which the API server carries out in two
//!   writes: the grace period shortened to 0 (an update event), then the
//!   removal. A pod whose grace period is already 0 is therefore left
//!   alone: it is being removed by the request that set it. Without that
//!   rule kwok played the Stage again on the update event, lost the race
//!   with the removal, and sent a second delete for every pod, each
//!   answered 404: 246 wasted requests among the scale benchmark's 20
//!   concurrent drains, when the API server was at its busiest.
//! * `volume-attach`: the attach-detach controller's VolumeAttachment gets
//!   the attacher's finalizer and, after the attach delay, `status.attached:
//!   true`, which is what a CSI external-attacher does.
//! * `volume-detach`: once the attach-detach controller deletes the
//!   VolumeAttachment (the pod is gone), the finalizer is removed after the
//!   detach delay, so the object disappears as it would when a cloud disk
//!   detaches.

use std::time::Duration;

/// How often kwok refreshes a Ready Node's status unless told otherwise.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(20);

/// CSI driver name that the test bed's attacher serves.
pub const CSI_DRIVER: &str = "csi.testbed.berth.dev";
/// Finalizer the simulated attacher puts on VolumeAttachments it attached.
pub const ATTACHER_FINALIZER: &str = "external-attacher/csi-testbed-berth-dev";
/// A Running pod with this annotation (a Go duration, e.g. `"1s"`) turns
/// `Succeeded` after that long.
pub const COMPLETE_AFTER_ANNOTATION: &str = "testbed.berth.dev/complete-after";
/// A terminating pod with this annotation (a Go duration) is removed after
/// that long instead of at the end of its grace period.
pub const TERMINATE_AFTER_ANNOTATION: &str = "testbed.berth.dev/terminate-after";

/// A pod with this annotation (any value) never starts: it stays
/// `Pending` on the Node it is bound to.
pub const NEVER_START_ANNOTATION: &str = "testbed.berth.dev/never-start";
/// A pod with this annotation (a Go duration) runs at once but turns Ready
/// only after that long.
pub const READY_AFTER_ANNOTATION: &str = "testbed.berth.dev/ready-after";
/// A Node annotated so dies: kwok's `node-dead` Stage turns it NotReady
/// at once, and it is neither initialised nor given heartbeats again
/// until the annotation goes. (A Stage, not a test's own status write:
/// kwok plays a heartbeat it scheduled before the write unless a newer
/// Stage replaces it, and would make the Node Ready again.)
pub const DEAD_ANNOTATION: &str = "testbed.berth.dev/dead";

/// Pod Stages kwok plays at once (its default is 4). Each play is an API
/// request; with 20 Machines drained together, 4 workers queued pod
/// deletions seconds behind their grace periods.
pub const POD_STAGE_WORKERS: u32 = 16;
/// Node Stages kwok plays at once (its default is 4).
pub const NODE_STAGE_WORKERS: u32 = 8;

/// The kwok configuration (a multi-document YAML: kwok's own settings, then
/// the Stages). kwok applies no defaults to a KwokConfiguration it reads,
/// so every option it would default is spelled out, at kwok's defaults
/// where not said otherwise; the flags the test bed passes win over these.
///
/// A Ready Node's status is refreshed after a delay drawn uniformly
/// between half of `heartbeat` and one and a half times it (kwok draws each
/// delay from `[durationMilliseconds, jitterDurationMilliseconds]`), so
/// every `heartbeat` on average. The spread is that wide because Nodes
/// created within the same minute otherwise keep beating together: drawn
/// from `[heartbeat, 1.25 × heartbeat]`, the scale benchmark's 1,000 Nodes
/// sent their first refresh as one wave (11-12 a second, against 3 on
/// average) that fell on the drains being measured.
pub fn kwok_config(attach_delay: Duration, detach_delay: Duration, heartbeat: Duration) -> String {
    let attach_ms = attach_delay.as_millis();
    let detach_ms = detach_delay.as_millis();
    let beat_min_ms = heartbeat.as_millis() / 2;
    let beat_max_ms = heartbeat.as_millis() * 3 / 2;
    let ready_status = pod_status(true, true);
    let unready_status = pod_status(false, true);
    let turned_ready_status = pod_status(true, false);
    format!(
        r#"apiVersion: config.kwok.x-k8s.io/v1alpha1
kind: KwokConfiguration
options:
  cidr: 10.0.0.0/24
  manageAllNodes: false
  enableDebuggingHandlers: true
  enableContentionProfiling: false
  enableProfilingHandler: false
  podPlayStageParallelism: {POD_STAGE_WORKERS}
  nodePlayStageParallelism: {NODE_STAGE_WORKERS}
  nodeLeaseParallelism: 4
  nodeLeaseDurationSeconds: 40
  podsOnNodeSyncParallelism: 1
  enablePodsOnNodeSyncListPager: true
  enablePodsOnNodeSyncStreamWatch: false
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: node-initialize
spec:
  resourceRef:
    apiGroup: v1
    kind: Node
  selector:
    matchExpressions:
    - key: '.status.conditions.[] | select( .type == "Ready" ) | .status'
      operator: NotIn
      values: ['True']
    - key: '.metadata.annotations["{DEAD_ANNOTATION}"]'
      operator: DoesNotExist
  next:
    statusTemplate: |
      {{{{ $now := Now }}}}
      conditions:
      {{{{ range NodeConditions }}}}
      - lastHeartbeatTime: {{{{ $now | Quote }}}}
        lastTransitionTime: {{{{ $now | Quote }}}}
        message: {{{{ .message | Quote }}}}
        reason: {{{{ .reason | Quote }}}}
        status: {{{{ .status | Quote }}}}
        type: {{{{ .type | Quote }}}}
      {{{{ end }}}}
      addresses:
      {{{{ with NodeIP }}}}
      - address: {{{{ . | Quote }}}}
        type: InternalIP
      {{{{ end }}}}
      {{{{ with NodeName }}}}
      - address: {{{{ . | Quote }}}}
        type: Hostname
      {{{{ end }}}}
      allocatable:
      {{{{ with .status.allocatable }}}}
      {{{{ YAML . 1 }}}}
      {{{{ else }}}}
        cpu: 1k
        memory: 1Ti
        pods: 1M
      {{{{ end }}}}
      capacity:
      {{{{ with .status.capacity }}}}
      {{{{ YAML . 1 }}}}
      {{{{ else }}}}
        cpu: 1k
        memory: 1Ti
        pods: 1M
      {{{{ end }}}}
      nodeInfo:
        architecture: amd64
        bootID: ""
        containerRuntimeVersion: kwok
        kernelVersion: kwok
        kubeProxyVersion: kwok
        kubeletVersion: kwok
        machineID: ""
        operatingSystem: linux
        osImage: ""
        systemUUID: ""
      phase: Running
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: node-heartbeat
spec:
  resourceRef:
    apiGroup: v1
    kind: Node
  selector:
    matchExpressions:
    - key: '.status.phase'
      operator: In
      values: ['Running']
    - key: '.status.conditions.[] | select( .type == "Ready" ) | .status'
      operator: In
      values: ['True']
    - key: '.metadata.annotations["{DEAD_ANNOTATION}"]'
      operator: DoesNotExist
  delay:
    durationMilliseconds: {beat_min_ms}
    jitterDurationMilliseconds: {beat_max_ms}
  next:
    statusTemplate: |
      {{{{ $now := Now }}}}
      conditions:
      {{{{ range NodeConditions }}}}
      - lastHeartbeatTime: {{{{ $now | Quote }}}}
        lastTransitionTime: {{{{ $now | Quote }}}}
        message: {{{{ .message | Quote }}}}
        reason: {{{{ .reason | Quote }}}}
        status: {{{{ .status | Quote }}}}
        type: {{{{ .type | Quote }}}}
      {{{{ end }}}}
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: node-dead
spec:
  resourceRef:
    apiGroup: v1
    kind: Node
  selector:
    matchExpressions:
    - key: '.metadata.annotations["{DEAD_ANNOTATION}"]'
      operator: Exists
    - key: '.status.conditions.[] | select( .type == "Ready" ) | .status'
      operator: In
      values: ['True']
  next:
    statusTemplate: |
      {{{{ $now := Now }}}}
      conditions:
      - lastHeartbeatTime: {{{{ $now | Quote }}}}
        lastTransitionTime: {{{{ $now | Quote }}}}
        message: "the test bed killed this Node's kubelet"
        reason: KubeletDown
        status: "False"
        type: Ready
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-ready
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: DoesNotExist
    - key: '.status.phase'
      operator: In
      values: ['Pending']
    - key: '.metadata.annotations["{NEVER_START_ANNOTATION}"]'
      operator: DoesNotExist
    - key: '.metadata.annotations["{READY_AFTER_ANNOTATION}"]'
      operator: DoesNotExist
  next:
    statusTemplate: |
{ready_status}
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-start-unready
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: DoesNotExist
    - key: '.status.phase'
      operator: In
      values: ['Pending']
    - key: '.metadata.annotations["{NEVER_START_ANNOTATION}"]'
      operator: DoesNotExist
    - key: '.metadata.annotations["{READY_AFTER_ANNOTATION}"]'
      operator: Exists
  next:
    statusTemplate: |
{unready_status}
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-ready-after
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: DoesNotExist
    - key: '.status.phase'
      operator: In
      values: ['Running']
    - key: '.metadata.annotations["{READY_AFTER_ANNOTATION}"]'
      operator: Exists
    - key: '.status.conditions.[] | select( .type == "Ready" ) | .status'
      operator: NotIn
      values: ['True']
  delay:
    durationMilliseconds: 0
    durationFrom:
      expressionFrom: '.metadata.annotations["{READY_AFTER_ANNOTATION}"]'
  next:
    statusTemplate: |
{turned_ready_status}
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-complete
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: DoesNotExist
    - key: '.status.phase'
      operator: In
      values: ['Running']
    - key: '.metadata.annotations["{COMPLETE_AFTER_ANNOTATION}"]'
      operator: Exists
  delay:
    durationMilliseconds: 0
    durationFrom:
      expressionFrom: '.metadata.annotations["{COMPLETE_AFTER_ANNOTATION}"]'
  next:
    statusTemplate: |
      {{{{ $now := Now }}}}
      containerStatuses:
      {{{{ range .spec.containers }}}}
      - image: {{{{ .image | Quote }}}}
        name: {{{{ .name | Quote }}}}
        ready: false
        started: false
        restartCount: 0
        state:
          terminated:
            exitCode: 0
            reason: Completed
            startedAt: {{{{ $now | Quote }}}}
            finishedAt: {{{{ $now | Quote }}}}
      {{{{ end }}}}
      phase: Succeeded
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-delete
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: Exists
    - key: '.metadata.deletionGracePeriodSeconds == 0'
      operator: NotIn
      values: ['true']
  delay:
    durationMilliseconds: 0
    durationFrom:
      expressionFrom: '.metadata.annotations["{TERMINATE_AFTER_ANNOTATION}"] // .metadata.deletionTimestamp'
  next:
    delete: true
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: volume-attach
spec:
  resourceRef:
    apiGroup: storage.k8s.io/v1
    kind: VolumeAttachment
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: DoesNotExist
    - key: '.spec.attacher'
      operator: In
      values: ['{CSI_DRIVER}']
    - key: '.status.attached'
      operator: NotIn
      values: ['true']
  delay:
    durationMilliseconds: {attach_ms}
  next:
    finalizers:
      add:
      - value: '{ATTACHER_FINALIZER}'
    statusTemplate: |
      attached: true
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: volume-detach
spec:
  resourceRef:
    apiGroup: storage.k8s.io/v1
    kind: VolumeAttachment
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: Exists
    - key: '.metadata.finalizers.[]'
      operator: In
      values: ['{ATTACHER_FINALIZER}']
  delay:
    durationMilliseconds: {detach_ms}
  next:
    finalizers:
      remove:
      - value: '{ATTACHER_FINALIZER}'
"#
    )
}

/// The status template (indented for a Stage's `statusTemplate`) of a
/// running pod, Ready or not; `starting` also sets what a pod gets when it
/// starts (its phase, start time and host IP), which a pod turning Ready
/// later keeps.
fn pod_status(ready: bool, starting: bool) -> String {
    let ready = if ready { "True" } else { "False" };
    let container_ready = if ready == "True" { "true" } else { "false" };
    let mut t = String::from("      {{ $now := Now }}\n      conditions:\n");
    for (kind, status) in [
        ("Initialized", "True"),
        ("Ready", ready),
        ("ContainersReady", ready),
        ("PodScheduled", "True"),
    ] {
        t.push_str(&format!(
            "      - lastTransitionTime: {{{{ $now | Quote }}}}\n        status: \"{status}\"\n        type: {kind}\n"
        ));
    }
    t.push_str(&format!(
        "      containerStatuses:\n      {{{{ range .spec.containers }}}}\n      - image: {{{{ .image | Quote }}}}\n        name: {{{{ .name | Quote }}}}\n        ready: {container_ready}\n        started: true\n        restartCount: 0\n        state:\n          running:\n            startedAt: {{{{ $now | Quote }}}}\n      {{{{ end }}}}\n"
    ));
    if starting {
        t.push_str(
            "      {{ with NodeIPsWith .spec.nodeName }}\n      hostIP: {{ index . 0 | Quote }}\n      {{ end }}\n      phase: Running\n      startTime: {{ $now | Quote }}\n",
        );
    }
    t.pop();
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_are_rendered_in_milliseconds() {
        let cfg = kwok_config(
            Duration::from_millis(1500),
            Duration::from_secs(2),
            DEFAULT_HEARTBEAT,
        );
        assert!(cfg.contains("durationMilliseconds: 1500\n  next:\n    finalizers:\n      add:"));
        assert!(
            cfg.contains("durationMilliseconds: 2000\n  next:\n    finalizers:\n      remove:")
        );
    }

    #[test]
    fn heartbeats_spread_around_their_mean_and_grace_zero_pods_are_left_alone() {
        let cfg = kwok_config(Duration::ZERO, Duration::ZERO, Duration::from_secs(20));
        assert!(
            cfg.contains("durationMilliseconds: 10000\n    jitterDurationMilliseconds: 30000\n"),
            "a refresh every 10 to 30 s, 20 s on average:\n{cfg}"
        );
        let delete = cfg
            .split("\n---\n")
            .find(|d| d.contains("name: pod-delete\n"))
            .expect("the pod-delete Stage");
        assert!(
            delete.contains(
                "- key: '.metadata.deletionGracePeriodSeconds == 0'\n      operator: NotIn\n      values: ['true']"
            ),
            "{delete}"
        );
    }

    #[test]
    fn a_pod_can_start_unready_and_turn_ready_later_or_never_start() {
        let cfg = kwok_config(Duration::ZERO, Duration::ZERO, DEFAULT_HEARTBEAT);
        let stage = |name: &str| {
            cfg.split("\n---\n")
                .find(|d| d.contains(&format!("name: {name}\n")))
                .unwrap_or_else(|| panic!("the {name} Stage"))
                .to_string()
        };
        let ready = stage("pod-ready");
        for skipped in [NEVER_START_ANNOTATION, READY_AFTER_ANNOTATION] {
            assert!(
                ready.contains(&format!(
                    "- key: '.metadata.annotations[\"{skipped}\"]'\n      operator: DoesNotExist"
                )),
                "{ready}"
            );
        }
        assert!(
            ready.contains("        status: \"True\"\n        type: Ready\n"),
            "{ready}"
        );
        assert!(
            ready.contains("        ready: true\n        started: true\n"),
            "{ready}"
        );
        assert!(
            ready.ends_with("      phase: Running\n      startTime: {{ $now | Quote }}"),
            "{ready}"
        );
        let unready = stage("pod-start-unready");
        assert!(
            unready.contains("        status: \"False\"\n        type: Ready\n"),
            "{unready}"
        );
        assert!(
            unready.contains("        ready: false\n        started: true\n"),
            "{unready}"
        );
        assert!(unready.contains("      phase: Running\n"), "{unready}");
        let later = stage("pod-ready-after");
        assert!(later.contains(&format!(
            "expressionFrom: '.metadata.annotations[\"{READY_AFTER_ANNOTATION}\"]'"
        )));
        assert!(
            later.contains("        status: \"True\"\n        type: Ready\n"),
            "{later}"
        );
        assert!(
            !later.contains("startTime"),
            "turning Ready keeps when it started: {later}"
        );
    }

    #[test]
    fn go_template_braces_survive_formatting() {
        let cfg = kwok_config(Duration::ZERO, Duration::ZERO, DEFAULT_HEARTBEAT);
        assert!(cfg.contains("{{ $now := Now }}"));
        assert!(!cfg.contains("{{{{"));
        assert_eq!(
            cfg.matches("\n---\n").count(),
            10,
            "kwok's settings and ten Stage documents"
        );
        assert!(
            cfg.starts_with("apiVersion: config.kwok.x-k8s.io/v1alpha1\nkind: KwokConfiguration\n")
        );
        assert!(cfg.contains(&format!("podPlayStageParallelism: {POD_STAGE_WORKERS}\n")));
    }
}
