// strait-controlplane: one binary that runs the real Kubernetes components
// testenv needs, each as its own process:
//
//	strait-controlplane etcd [etcd flags]
//	strait-controlplane kube-apiserver [flags]
//	strait-controlplane kube-controller-manager [flags]
//	strait-controlplane kube-scheduler [flags]        (real-node clusters)
//	strait-controlplane kubelet [flags]               (real nodes)
//	strait-controlplane kube-proxy [flags]            (real nodes)
//	strait-controlplane coredns [coredns flags]       (cluster DNS of real-node clusters)
//	strait-controlplane version
//
// One binary keeps the build (and its cache) single: the components share
// most of their dependency graph (client-go, apimachinery, component-base), so
// linking them together is far cheaper than separate builds on a 2-core machine.
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/spf13/cobra"
	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	"k8s.io/component-base/version"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	proxy "k8s.io/kubernetes/cmd/kube-proxy/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"

	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"
	// The CoreDNS plugins a cluster's Corefile uses (kubeadm's default Corefile, plus bind).
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"
)

func usage() {
	fmt.Fprintf(os.Stderr, "usage: %s etcd|kube-apiserver|kube-controller-manager|kube-scheduler|kubelet|kube-proxy|coredns|version [flags]\n", os.Args[0])
	os.Exit(2)
}

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	sub, args := os.Args[1], os.Args[2:]
	switch sub {
	case "etcd":
		// etcdmain reads os.Args itself for some flags; present it as a plain etcd.
		etcdmain.Main(append([]string{"etcd"}, args...))
	case "kube-apiserver":
		run(apiserver.NewAPIServerCommand(), args)
	case "kube-controller-manager":
		run(controllermanager.NewControllerManagerCommand(), args)
	case "kube-scheduler":
		run(scheduler.NewSchedulerCommand(), args)
	case "kubelet":
		run(kubelet.NewKubeletCommand(context.Background()), args)
	case "kube-proxy":
		run(proxy.NewProxyCommand(), args)
	case "coredns":
		// CoreDNS parses os.Args with the flag package; present it as a plain coredns.
		os.Args = append([]string{"coredns"}, args...)
		dnsserver.Directives = directives
		coremain.Run()
	case "version":
		fmt.Println(version.Get().GitVersion)
	default:
		usage()
	}
}

// directives: the order CoreDNS runs the linked plugins in (a subset of its
// plugin.cfg, same relative order).
var directives = []string{
	"reload",
	"bind",
	"ready",
	"health",
	"errors",
	"log",
	"loadbalance",
	"cache",
	"kubernetes",
	"loop",
	"forward",
}

func run(cmd *cobra.Command, args []string) {
	cmd.SetArgs(args)
	os.Exit(cli.Run(cmd))
}
