// Command etcd is etcd's server, built from the etcd module that
// k8s.io/kubernetes pins (etcd's own main.go does the same).
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
