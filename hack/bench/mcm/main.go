// Command mcm-drain drains one Node with Gardener machine-controller-manager's
// drain package (pkg/util/provider/drain), the design berth replaces, so the
// benchmark can time it against berth on the same cluster.
//
// It wires the package the way MCM's machine controller does (see
// pkg/util/provider/machinecontroller in the pinned release): shared informers
// for Pods, PVCs, PVs, PDBs, Nodes and VolumeAttachments, a
// VolumeAttachmentHandler fed by the VolumeAttachment informer, and the same
// fixed arguments to NewDrainOptions (grace period -1, ignore pods without
// controllers, ignore DaemonSets, delete local data). The Driver only answers
// GetVolumeIDs, with the CSI volume handle of each PV. RunDrain cordons the
// Node itself (Node.spec.unschedulable, by update), so nothing is cordoned here.
//
// Stdout carries exactly one line of JSON:
//
//	{"peer":"mcm","version":"v0.62.1","node":"a","wall_seconds":12.3,"error":null}
//
// wall_seconds is the time spent in RunDrain only; client and informer set-up
// (which a running MCM has already done) is not counted. Logs go to stderr.
//
// Exit status: 0 drained, 1 the drain failed or ran out of time, 2 bad usage
// or set-up failure (no drain was attempted).
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"runtime/debug"
	"syscall"
	"time"

	"github.com/Masterminds/semver/v3"
	"github.com/gardener/machine-controller-manager/pkg/util/provider/drain"
	"github.com/gardener/machine-controller-manager/pkg/util/provider/driver"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
)

const mcmModule = "github.com/gardener/machine-controller-manager"

type result struct {
	Peer        string  `json:"peer"`
	Version     string  `json:"version"`
	Node        string  `json:"node"`
	WallSeconds float64 `json:"wall_seconds"`
	Error       *string `json:"error"`
}

func main() {
	os.Exit(run())
}

func run() int {
	var (
		kubeconfig        = flag.String("kubeconfig", "", "path to a kubeconfig (default: $KUBECONFIG, then ~/.kube/config)")
		node              = flag.String("node", "", "the Node to drain (required)")
		timeout           = flag.Duration("timeout", drain.DefaultMachineDrainTimeout, "drain timeout (MCM --machine-drain-timeout)")
		maxEvictRetries   = flag.Int("max-evict-retries", int(drain.DefaultMaxEvictRetries), "evictions tried per pod before it is deleted (MCM --machine-max-evict-retries; retries are 20s apart)")
		pvDetachTimeout   = flag.Duration("pv-detach-timeout", 2*time.Minute, "wait for a pod's volumes to detach, on top of its grace period (MCM --machine-pv-detach-timeout)")
		pvReattachTimeout = flag.Duration("pv-reattach-timeout", 90*time.Second, "wait for a pod's volumes to attach elsewhere (MCM --machine-pv-reattach-timeout)")
		force             = flag.Bool("force", false, "delete pods instead of evicting them and wait for neither pods nor volumes (MCM's forced drain)")
		verbosity         = flag.Int("v", 0, "klog verbosity of MCM's drain logs (stderr); 3 and 4 trace every step")
	)
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: %s --node NAME [flags]\n", os.Args[0])
		flag.PrintDefaults()
	}
	flag.Parse()

	out := result{Peer: "mcm", Version: mcmVersion(), Node: *node}
	emit := func(code int, err error) int {
		if err != nil {
			msg := err.Error()
			out.Error = &msg
		}
		line, _ := json.Marshal(out)
		fmt.Println(string(line))
		return code
	}

	switch {
	case flag.NArg() > 0:
		return emit(2, fmt.Errorf("unexpected arguments: %v", flag.Args()))
	case *node == "":
		return emit(2, errors.New("--node is required"))
	case *timeout <= 0, *pvDetachTimeout < 0, *pvReattachTimeout < 0:
		return emit(2, errors.New("--timeout must be positive and the PV timeouts non-negative"))
	case *maxEvictRetries < 0 || *maxEvictRetries > 1<<31-1:
		return emit(2, errors.New("--max-evict-retries must be a non-negative int32"))
	}

	klogFlags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(klogFlags)
	_ = klogFlags.Set("v", fmt.Sprint(*verbosity))
	defer klog.Flush()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = *kubeconfig
	config, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, nil).ClientConfig()
	if err != nil {
		return emit(2, fmt.Errorf("kubeconfig: %w", err))
	}
	config.UserAgent = "berth-bench-mcm-drain"
	// MCM's defaults for its target-cluster client (--kube-api-qps/-burst).
	config.QPS, config.Burst = 20, 30
	client, err := kubernetes.NewForConfig(config)
	if err != nil {
		return emit(2, fmt.Errorf("client: %w", err))
	}

	info, err := client.Discovery().ServerVersion()
	if err != nil {
		return emit(2, fmt.Errorf("server version: %w", err))
	}
	kubeVersion, err := semver.NewVersion(info.GitVersion)
	if err != nil {
		return emit(2, fmt.Errorf("server version %q: %w", info.GitVersion, err))
	}

	// RunDrain treats a missing Node as drained (a machine deleted before it
	// registered); for a benchmark that would hide a wrong --node.
	if _, err := client.CoreV1().Nodes().Get(ctx, *node, metav1.GetOptions{}); err != nil {
		return emit(2, fmt.Errorf("node %q: %w", *node, err))
	}

	// A factory starts only the informers asked for before Start, so every
	// lister and informer the drain uses is taken here.
	factory := informers.NewSharedInformerFactory(client, 0)
	pods := factory.Core().V1().Pods()
	pvcs := factory.Core().V1().PersistentVolumeClaims().Lister()
	pvs := factory.Core().V1().PersistentVolumes().Lister()
	nodes := factory.Core().V1().Nodes().Lister()
	pdbs := factory.Policy().V1().PodDisruptionBudgets().Lister()
	podLister, podSynced := pods.Lister(), pods.Informer().HasSynced

	attachments := drain.NewVolumeAttachmentHandler()
	if _, err := factory.Storage().V1().VolumeAttachments().Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    attachments.AddVolumeAttachment,
		UpdateFunc: attachments.UpdateVolumeAttachment,
	}); err != nil {
		return emit(2, fmt.Errorf("volume attachment handler: %w", err))
	}

	// Stopped by cancel; not shut down and waited for, since the process exits
	// right after the result line (and MCM may leave goroutines behind on its
	// deadline).
	factory.Start(ctx.Done())
	for typ, ok := range factory.WaitForCacheSync(ctx.Done()) {
		if !ok {
			return emit(2, fmt.Errorf("informer cache for %v did not sync", typ))
		}
	}

	opts := drain.NewDrainOptions(
		client,
		kubeVersion,
		*timeout,
		int32(*maxEvictRetries),
		*pvDetachTimeout,
		*pvReattachTimeout,
		*node,
		-1,     // gracePeriodSeconds: the pod's own, as MCM passes
		*force, // forceDeletePods
		true,   // ignorePodsWithoutControllers, as MCM passes
		true,   // ignoreDaemonsets, as MCM passes
		true,   // deleteLocalData, as MCM passes
		os.Stderr,
		os.Stderr,
		csiDriver{},
		pvcs,
		pvs,
		pdbs,
		nodes,
		podLister,
		attachments,
		podSynced,
	)

	start := time.Now()
	err = opts.RunDrain(ctx)
	elapsed := time.Since(start)
	out.WallSeconds = elapsed.Seconds()

	if err == nil && elapsed >= *timeout {
		// On its deadline RunDrain abandons the remaining pods and returns nil
		// (MCM then goes on to delete the machine). Nothing was drained to the
		// end, so the benchmark must not count it as a success.
		err = fmt.Errorf("drain deadline of %s reached; RunDrain returned no error but gave up on the remaining pods", *timeout)
	}
	if err == nil && ctx.Err() != nil {
		err = fmt.Errorf("interrupted: %w", ctx.Err())
	}
	if err != nil {
		return emit(1, err)
	}
	return emit(0, nil)
}

// mcmVersion is the version of the MCM module linked into this binary.
func mcmVersion() string {
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, dep := range bi.Deps {
			if dep.Path == mcmModule {
				if dep.Replace != nil {
					return dep.Replace.Version
				}
				return dep.Version
			}
		}
	}
	return "unknown"
}

// csiDriver is the part of an MCM provider driver that the drain uses: it maps
// PersistentVolumes to the volume IDs that show up in Node.status.volumesAttached.
// Like a provider's driver it returns nothing for volumes it does not serve
// (here: anything that is not CSI), so the drain does not wait for them.
type csiDriver struct{}

var _ driver.Driver = csiDriver{}

var errNotADriver = errors.New("mcm-drain: only GetVolumeIDs is implemented")

func (csiDriver) GetVolumeIDs(_ context.Context, req *driver.GetVolumeIDsRequest) (*driver.GetVolumeIDsResponse, error) {
	ids := []string{}
	for _, spec := range req.PVSpecs {
		if id := csiVolumeHandle(spec); id != "" {
			ids = append(ids, id)
		}
	}
	return &driver.GetVolumeIDsResponse{VolumeIDs: ids}, nil
}

func csiVolumeHandle(spec *corev1.PersistentVolumeSpec) string {
	if spec == nil || spec.CSI == nil {
		return ""
	}
	return spec.CSI.VolumeHandle
}

func (csiDriver) CreateMachine(context.Context, *driver.CreateMachineRequest) (*driver.CreateMachineResponse, error) {
	return nil, errNotADriver
}

func (csiDriver) InitializeMachine(context.Context, *driver.InitializeMachineRequest) (*driver.InitializeMachineResponse, error) {
	return nil, errNotADriver
}

func (csiDriver) DeleteMachine(context.Context, *driver.DeleteMachineRequest) (*driver.DeleteMachineResponse, error) {
	return nil, errNotADriver
}

func (csiDriver) GetMachineStatus(context.Context, *driver.GetMachineStatusRequest) (*driver.GetMachineStatusResponse, error) {
	return nil, errNotADriver
}

func (csiDriver) ListMachines(context.Context, *driver.ListMachinesRequest) (*driver.ListMachinesResponse, error) {
	return nil, errNotADriver
}
