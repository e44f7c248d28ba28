// strait-controlplane: one binary that runs the real Kubernetes control-plane
// components testenv needs, each as its own process:
//
//	strait-controlplane etcd [etcd flags]
//	strait-controlplane kube-apiserver [flags]
//	strait-controlplane kube-controller-manager [flags]
//	strait-controlplane version
//
// One binary keeps the build (and its cache) single: the three components share
// most of their dependency graph, so linking them together is far cheaper than
// three separate builds on a 2-core machine.
package main

import (
	"fmt"
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	"k8s.io/component-base/version"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
)

func usage() {
	fmt.Fprintf(os.Stderr, "usage: %s etcd|kube-apiserver|kube-controller-manager|version [flags]\n", os.Args[0])
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
		cmd := apiserver.NewAPIServerCommand()
		cmd.SetArgs(args)
		os.Exit(cli.Run(cmd))
	case "kube-controller-manager":
		cmd := controllermanager.NewControllerManagerCommand()
		cmd.SetArgs(args)
		os.Exit(cli.Run(cmd))
	case "version":
		fmt.Println(version.Get().GitVersion)
	default:
		usage()
	}
}
